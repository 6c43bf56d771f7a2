// SPDX-License-Identifier: GPL-2.0-only
/*
 * KUnit tests of block fingerprints (dedup-fingerprint.c): which hashes
 * are accepted, and known digests of whole blocks.
 */
#include <kunit/test.h>
#include <linux/unaligned.h>

#include "dedup-fingerprint.h"
#include "dedup-test-util.h"

/* SHA-256 of 4096 zero bytes. */
static const u8 dd_sha256_zero_block[32] = {
	0xad, 0x7f, 0xac, 0xb2, 0x58, 0x6f, 0xc6, 0xe9,
	0x66, 0xc0, 0x04, 0xd7, 0xd1, 0xd1, 0x6b, 0x02,
	0x4f, 0x58, 0x05, 0xff, 0x7c, 0xb4, 0x7c, 0x7a,
	0x85, 0xda, 0xbd, 0x8b, 0x48, 0x89, 0x2c, 0xa7,
};

KUNIT_DEFINE_ACTION_WRAPPER(dd_test_hasher_put, dd_hasher_exit,
			    struct dd_hasher *);

static struct dd_hasher *dd_test_hasher(struct kunit *test, const char *name)
{
	struct dd_hasher *h = kunit_kzalloc(test, sizeof(*h), GFP_KERNEL);
	char *error = NULL;

	KUNIT_ASSERT_NOT_NULL(test, h);
	KUNIT_ASSERT_EQ_MSG(test, dd_hasher_init(h, name, &error), 0,
			    "%s: %s", name, error ?: "");
	KUNIT_ASSERT_EQ(test,
			kunit_add_action_or_reset(test, dd_test_hasher_put, h),
			0);
	return h;
}

static void dd_fp_test_hasher_choice(struct kunit *test)
{
	struct dd_hasher *h;
	struct dd_hasher bad = {};
	char *error = NULL;

	h = dd_test_hasher(test, "sha256");
	KUNIT_EXPECT_EQ(test, h->fp_size, 32);
	KUNIT_EXPECT_TRUE(test, h->strong);
	KUNIT_EXPECT_STREQ(test, dd_hasher_name(h), "sha256");

	/* short, and not collision resistant: needs verify */
	h = dd_test_hasher(test, "crc32c");
	KUNIT_EXPECT_EQ(test, h->fp_size, 4);
	KUNIT_EXPECT_FALSE(test, h->strong);

	KUNIT_EXPECT_EQ(test, dd_hasher_init(&bad, "no-such-hash", &error),
			-EINVAL);
	KUNIT_EXPECT_NOT_NULL(test, error);
	KUNIT_EXPECT_NULL(test, bad.tfm);
	error = NULL;
	KUNIT_EXPECT_EQ(test, dd_hasher_init(&bad, "hmac(sha256)", &error),
			-EINVAL);
	KUNIT_EXPECT_STREQ(test, error,
			   "keyed hash algorithms are not supported");
	KUNIT_EXPECT_NULL(test, bad.tfm);
	dd_hasher_exit(&bad);
}

static void dd_fp_test_known_vectors(struct kunit *test)
{
	struct dd_hasher *sha = dd_test_hasher(test, "sha256");
	struct dd_hasher *crc = dd_test_hasher(test, "crc32c");
	u8 *data = kunit_kzalloc(test, DD_BLOCK_SIZE, GFP_KERNEL);
	u8 fp[DD_FP_SIZE], want[DD_FP_SIZE] = {};
	unsigned int i;

	KUNIT_ASSERT_NOT_NULL(test, data);
	memset(fp, 0xee, sizeof(fp));
	KUNIT_ASSERT_EQ(test, dd_fingerprint_block(sha, data, fp), 0);
	KUNIT_EXPECT_MEMEQ(test, fp, dd_sha256_zero_block, 32);

	/* as Documentation/dedup-format.rst says: the CRC, little-endian */
	for (i = 0; i < DD_BLOCK_SIZE; i++)
		data[i] = i * 7 + (i >> 9);
	put_unaligned_le32(dd_test_crc32c(data, DD_BLOCK_SIZE), want);
	memset(fp, 0xee, sizeof(fp));
	KUNIT_ASSERT_EQ(test, dd_fingerprint_block(crc, data, fp), 0);
	KUNIT_EXPECT_MEMEQ(test, fp, want, DD_FP_SIZE);
}

/* Every byte of the block counts, the last one too. */
static void dd_fp_test_whole_block(struct kunit *test)
{
	struct dd_hasher *sha = dd_test_hasher(test, "sha256");
	u8 *data = kunit_kmalloc(test, DD_BLOCK_SIZE, GFP_KERNEL);
	u8 fp[2][DD_FP_SIZE];

	KUNIT_ASSERT_NOT_NULL(test, data);
	dd_test_fp(data, 1);
	memset(data + DD_FP_SIZE, 0x3c, DD_BLOCK_SIZE - DD_FP_SIZE);
	KUNIT_ASSERT_EQ(test, dd_fingerprint_block(sha, data, fp[0]), 0);
	KUNIT_EXPECT_MEMNEQ(test, fp[0], dd_sha256_zero_block, DD_FP_SIZE);
	data[DD_BLOCK_SIZE - 1] ^= 1;
	KUNIT_ASSERT_EQ(test, dd_fingerprint_block(sha, data, fp[1]), 0);
	KUNIT_EXPECT_MEMNEQ(test, fp[0], fp[1], DD_FP_SIZE);
	data[DD_BLOCK_SIZE - 1] ^= 1;
	KUNIT_ASSERT_EQ(test, dd_fingerprint_block(sha, data, fp[1]), 0);
	KUNIT_EXPECT_MEMEQ(test, fp[0], fp[1], DD_FP_SIZE);
}

static struct kunit_case dd_fp_cases[] = {
	KUNIT_CASE(dd_fp_test_hasher_choice),
	KUNIT_CASE(dd_fp_test_known_vectors),
	KUNIT_CASE(dd_fp_test_whole_block),
	{}
};

static struct kunit_suite dd_fp_suite = {
	.name = "dm_dedup_fingerprint",
	.test_cases = dd_fp_cases,
};

kunit_test_suite(dd_fp_suite);
