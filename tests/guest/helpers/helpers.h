/* SPDX-License-Identifier: GPL-2.0-only */
/*
 * What the C helpers of the guest tests share: block size, exit on error,
 * and block contents made from a seed and an id.
 */
#ifndef DD_TEST_HELPERS_H
#define DD_TEST_HELPERS_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define BLK 4096

static inline void die(const char *what)
{
	perror(what);
	exit(2);
}

static inline uint64_t mix(uint64_t x)
{
	x ^= x >> 33;
	x *= 0xff51afd7ed558ccdULL;
	x ^= x >> 33;
	x *= 0xc4ceb9fe1a85ec53ULL;
	return x ^ (x >> 33);
}

/* Block @id's content for @seed. */
static inline void fill(unsigned char *p, uint64_t seed, uint64_t id)
{
	uint64_t s = mix(seed * 1000003 + id + 1);
	int i;

	for (i = 0; i < BLK; i += 8) {
		s = mix(s + i);
		memcpy(p + i, &s, 8);
	}
}

#endif
