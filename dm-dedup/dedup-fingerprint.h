/* SPDX-License-Identifier: GPL-2.0-only */
/*
 * Fingerprints of 4 KiB blocks through the kernel crypto API.
 */
#ifndef DM_DEDUP_FINGERPRINT_H
#define DM_DEDUP_FINGERPRINT_H

#include <linux/types.h>

#include "dedup-format.h"

struct crypto_shash;

struct dd_hasher {
	struct crypto_shash *tfm;
	u32 fp_size;		/* bytes kept, <= DD_FP_SIZE */
	bool strong;		/* collision resistant: equal means equal data */
};

int dd_hasher_init(struct dd_hasher *h, const char *name, char **error);
void dd_hasher_exit(struct dd_hasher *h);
const char *dd_hasher_name(const struct dd_hasher *h);
int dd_fingerprint_block(const struct dd_hasher *h, const void *data, u8 *fp);

#endif
