// SPDX-License-Identifier: GPL-2.0-only
/*
 * Fingerprints of 4 KiB blocks; see dedup-fingerprint.h.
 */
#include <crypto/hash.h>
#include <linux/string.h>

#include "dedup-fingerprint.h"

/*
 * Hashes accepted without byte verification: finding two blocks with the
 * same fingerprint must be infeasible, or a crafted block could be mapped
 * onto somebody else's data.
 */
static const char * const dd_strong_hashes[] = {
	"sha256", "sha384", "sha512", "sha3-256", "sha3-384", "sha3-512",
	"blake2b-256", "blake2b-384", "blake2b-512",
};

int dd_hasher_init(struct dd_hasher *h, const char *name, char **error)
{
	unsigned int i, size;

	h->tfm = crypto_alloc_shash(name, 0, 0);
	if (IS_ERR(h->tfm)) {
		int r = PTR_ERR(h->tfm);

		h->tfm = NULL;
		*error = "unknown hash algorithm (not available in the crypto API)";
		return r == -ENOENT ? -EINVAL : r;
	}
	if (crypto_shash_get_flags(h->tfm) & CRYPTO_TFM_NEED_KEY) {
		dd_hasher_exit(h);
		*error = "keyed hash algorithms are not supported";
		return -EINVAL;
	}
	if (strlen(crypto_shash_alg_name(h->tfm)) >= DD_HASH_NAME_LEN) {
		dd_hasher_exit(h);
		*error = "hash algorithm name too long";
		return -EINVAL;
	}
	size = crypto_shash_digestsize(h->tfm);
	if (size < 4) {
		dd_hasher_exit(h);
		*error = "hash digest too short to serve as a fingerprint";
		return -EINVAL;
	}
	h->fp_size = min_t(u32, size, DD_FP_SIZE);
	h->strong = false;
	for (i = 0; i < ARRAY_SIZE(dd_strong_hashes); i++)
		if (!strcmp(crypto_shash_alg_name(h->tfm), dd_strong_hashes[i]))
			h->strong = true;
	return 0;
}

void dd_hasher_exit(struct dd_hasher *h)
{
	if (h->tfm)
		crypto_free_shash(h->tfm);
	h->tfm = NULL;
}

const char *dd_hasher_name(const struct dd_hasher *h)
{
	return crypto_shash_alg_name(h->tfm);
}

/* @data is one 4 KiB block the target owns (dedup-data.h). */
int dd_fingerprint_block(const struct dd_hasher *h, const void *data, u8 *fp)
{
	SHASH_DESC_ON_STACK(desc, h->tfm);
	u8 digest[HASH_MAX_DIGESTSIZE];
	int r;

	desc->tfm = h->tfm;
	r = crypto_shash_digest(desc, data, DD_BLOCK_SIZE, digest);
	shash_desc_zero(desc);
	if (r)
		return r;
	memset(fp, 0, DD_FP_SIZE);
	memcpy(fp, digest, h->fp_size);
	return 0;
}
