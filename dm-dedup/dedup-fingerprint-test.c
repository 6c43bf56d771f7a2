// SPDX-License-Identifier: GPL-2.0-only
/*
 * KUnit tests of block fingerprints (dedup-fingerprint.c): which hashes
 * are accepted, and that a block's fingerprint does not depend on how its
 * bio is split into segments.
 */
#include <kunit/test.h>
#include <linux/bio.h>

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

/*
 * A bio over @data, one 4 KiB block, cut into @nr_segs segments of
 * unequal length, from two separate buffers.
 */
struct dd_test_bio {
	struct bio bio;
	struct bio_vec bvec[3];
	u8 *second;
};

static struct bio *dd_test_bio(struct kunit *test, const u8 *data,
			       unsigned int nr_segs)
{
	static const unsigned int cut[3][3] = {
		{ 4096 }, { 512, 3584 }, { 1, 2047, 2048 },
	};
	struct dd_test_bio *tb = kunit_kzalloc(test, sizeof(*tb), GFP_KERNEL);
	u8 *buf = kunit_kmalloc(test, 2 * DD_BLOCK_SIZE, GFP_KERNEL);
	unsigned int i, off = 0;

	KUNIT_ASSERT_NOT_NULL(test, tb);
	KUNIT_ASSERT_NOT_NULL(test, buf);
	KUNIT_ASSERT_TRUE(test, nr_segs >= 1 && nr_segs <= 3);
	/* each segment lives at its own offset of a page of its own */
	memcpy(buf, data, DD_BLOCK_SIZE);
	tb->second = buf + DD_BLOCK_SIZE;
	memcpy(tb->second, data, DD_BLOCK_SIZE);
	bio_init(&tb->bio, NULL, tb->bvec, ARRAY_SIZE(tb->bvec), REQ_OP_WRITE);
	for (i = 0; i < nr_segs; i++) {
		u8 *p = (i % 2 ? tb->second : buf) + off;

		__bio_add_page(&tb->bio, virt_to_page(p), cut[nr_segs - 1][i],
			       offset_in_page(p));
		off += cut[nr_segs - 1][i];
	}
	KUNIT_ASSERT_EQ(test, tb->bio.bi_iter.bi_size, DD_BLOCK_SIZE);
	return &tb->bio;
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
	unsigned int segs, i;
	struct bio *bio;

	KUNIT_ASSERT_NOT_NULL(test, data);
	for (segs = 1; segs <= 3; segs++) {
		bio = dd_test_bio(test, data, segs);
		memset(fp, 0xee, sizeof(fp));
		KUNIT_ASSERT_EQ(test, dd_fingerprint_bio(sha, bio, fp), 0);
		KUNIT_EXPECT_MEMEQ(test, fp, dd_sha256_zero_block, 32);
	}

	/* as Documentation/dedup-format.rst says: the CRC, little-endian */
	for (i = 0; i < DD_BLOCK_SIZE; i++)
		data[i] = i * 7 + (i >> 9);
	put_unaligned_le32(dd_test_crc32c(data, DD_BLOCK_SIZE), want);
	for (segs = 1; segs <= 3; segs++) {
		bio = dd_test_bio(test, data, segs);
		memset(fp, 0xee, sizeof(fp));
		KUNIT_ASSERT_EQ(test, dd_fingerprint_bio(crc, bio, fp), 0);
		KUNIT_EXPECT_MEMEQ_MSG(test, fp, want, DD_FP_SIZE,
				       "%u segments", segs);
	}
}

/* The same content gives the same fingerprint however it is cut. */
static void dd_fp_test_segments(struct kunit *test)
{
	struct dd_hasher *sha = dd_test_hasher(test, "sha256");
	u8 *data = kunit_kmalloc(test, DD_BLOCK_SIZE, GFP_KERNEL);
	u8 fp[3][DD_FP_SIZE];
	unsigned int segs;
	struct bio *bio;
	int r;

	KUNIT_ASSERT_NOT_NULL(test, data);
	dd_test_fp(data, 1);
	memset(data + DD_FP_SIZE, 0x3c, DD_BLOCK_SIZE - DD_FP_SIZE);
	for (segs = 1; segs <= 3; segs++) {
		bio = dd_test_bio(test, data, segs);
		r = dd_fingerprint_bio(sha, bio, fp[segs - 1]);
		KUNIT_ASSERT_EQ(test, r, 0);
	}
	KUNIT_EXPECT_MEMEQ(test, fp[0], fp[1], DD_FP_SIZE);
	KUNIT_EXPECT_MEMEQ(test, fp[0], fp[2], DD_FP_SIZE);
	KUNIT_EXPECT_MEMNEQ(test, fp[0], dd_sha256_zero_block, DD_FP_SIZE);

	/* one bit in the last byte changes it */
	data[DD_BLOCK_SIZE - 1] ^= 1;
	bio = dd_test_bio(test, data, 3);
	KUNIT_ASSERT_EQ(test, dd_fingerprint_bio(sha, bio, fp[1]), 0);
	KUNIT_EXPECT_MEMNEQ(test, fp[0], fp[1], DD_FP_SIZE);
}

static void dd_fp_test_zero_block(struct kunit *test)
{
	static const unsigned int where[] = { 0, 511, 512, 2047, 2048, 4095 };
	u8 *data = kunit_kzalloc(test, DD_BLOCK_SIZE, GFP_KERNEL);
	unsigned int segs, i;
	struct bio *bio;

	KUNIT_ASSERT_NOT_NULL(test, data);
	for (segs = 1; segs <= 3; segs++) {
		bio = dd_test_bio(test, data, segs);
		KUNIT_EXPECT_TRUE(test, dd_bio_is_zero(bio));
	}
	for (i = 0; i < ARRAY_SIZE(where); i++) {
		data[where[i]] = 0x01;
		for (segs = 1; segs <= 3; segs++) {
			bio = dd_test_bio(test, data, segs);
			KUNIT_EXPECT_FALSE_MSG(test, dd_bio_is_zero(bio),
					       "byte %u, %u segments", where[i],
					       segs);
		}
		data[where[i]] = 0;
	}
}

static struct kunit_case dd_fp_cases[] = {
	KUNIT_CASE(dd_fp_test_hasher_choice),
	KUNIT_CASE(dd_fp_test_known_vectors),
	KUNIT_CASE(dd_fp_test_segments),
	KUNIT_CASE(dd_fp_test_zero_block),
	{}
};

static struct kunit_suite dd_fp_suite = {
	.name = "dm_dedup_fingerprint",
	.test_cases = dd_fp_cases,
};

kunit_test_suite(dd_fp_suite);
