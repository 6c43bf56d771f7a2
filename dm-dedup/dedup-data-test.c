// SPDX-License-Identifier: GPL-2.0-only
/*
 * KUnit tests of the target's copies of data blocks (dedup-data.c): a
 * copy holds what the bio carried however the bio is cut into segments,
 * and later changes to the bio's pages do not reach it; a stored block's
 * kept copy answers only for that block.
 */
#include <kunit/test.h>
#include <linux/bio.h>
#include <linux/highmem.h>

#include "dedup-data.h"
#include "dedup-format.h"

/*
 * A bio over @data, one 4 KiB block, cut into @nr_segs segments of
 * unequal length, from two separate buffers.
 */
struct dd_test_bio {
	struct bio bio;
	struct bio_vec bvec[3];
	u8 *first;
	u8 *second;
};

static struct dd_test_bio *dd_test_bio(struct kunit *test, const u8 *data,
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
	KUNIT_ASSERT_TRUE(test, PAGE_ALIGNED(buf));
	tb->first = buf;
	memcpy(tb->first, data, DD_BLOCK_SIZE);
	tb->second = buf + DD_BLOCK_SIZE;
	memcpy(tb->second, data, DD_BLOCK_SIZE);
	bio_init(&tb->bio, NULL, tb->bvec, ARRAY_SIZE(tb->bvec), REQ_OP_WRITE);
	for (i = 0; i < nr_segs; i++) {
		u8 *p = (i % 2 ? tb->second : tb->first) + off;

		__bio_add_page(&tb->bio, virt_to_page(p), cut[nr_segs - 1][i],
			       offset_in_page(p));
		off += cut[nr_segs - 1][i];
	}
	KUNIT_ASSERT_EQ(test, tb->bio.bi_iter.bi_size, DD_BLOCK_SIZE);
	return tb;
}

static struct dd_data_pool *dd_test_pool(struct kunit *test)
{
	struct dd_data_pool *pool = kunit_kzalloc(test, sizeof(*pool),
						  GFP_KERNEL);

	KUNIT_ASSERT_NOT_NULL(test, pool);
	KUNIT_ASSERT_EQ(test, dd_data_pool_init(pool, 2), 0);
	return pool;
}

static struct page *dd_test_copy(struct dd_data_pool *pool, struct bio *bio)
{
	struct page *page = NULL;

	dd_data_copy(pool, bio, &page, 1);
	return page;
}

static void dd_test_expect_page(struct kunit *test, struct page *page,
				const u8 *want, unsigned int segs)
{
	u8 *p = kmap_local_page(page);

	KUNIT_EXPECT_MEMEQ_MSG(test, p, want, DD_BLOCK_SIZE, "%u segments",
			       segs);
	kunmap_local(p);
}

/* The copy is the block, whatever the segments, and stays what it was. */
static void dd_data_test_copy(struct kunit *test)
{
	struct dd_data_pool *pool = dd_test_pool(test);
	u8 *data = kunit_kmalloc(test, DD_BLOCK_SIZE, GFP_KERNEL);
	struct dd_test_bio *tb;
	unsigned int segs, i;
	struct page *copy;

	KUNIT_ASSERT_NOT_NULL(test, data);
	for (i = 0; i < DD_BLOCK_SIZE; i++)
		data[i] = i * 13 + (i >> 8);
	for (segs = 1; segs <= 3; segs++) {
		tb = dd_test_bio(test, data, segs);
		copy = dd_test_copy(pool, &tb->bio);
		KUNIT_ASSERT_NOT_NULL(test, copy);
		dd_test_expect_page(test, copy, data, segs);
		/* the submitter changes its buffers after the copy */
		memset(tb->first, 0x5a, DD_BLOCK_SIZE);
		memset(tb->second, 0xa5, DD_BLOCK_SIZE);
		dd_test_expect_page(test, copy, data, segs);
		dd_data_put(pool, copy);
	}
	dd_data_pool_exit(pool);
}

static void dd_data_test_zero(struct kunit *test)
{
	static const unsigned int where[] = { 0, 511, 512, 2047, 2048, 4095 };
	struct dd_data_pool *pool = dd_test_pool(test);
	u8 *data = kunit_kzalloc(test, DD_BLOCK_SIZE, GFP_KERNEL);
	struct page *copy;
	unsigned int segs, i;

	KUNIT_ASSERT_NOT_NULL(test, data);
	for (segs = 1; segs <= 3; segs++) {
		copy = dd_test_copy(pool, &dd_test_bio(test, data, segs)->bio);
		KUNIT_EXPECT_TRUE(test, dd_data_is_zero(copy));
		dd_data_put(pool, copy);
	}
	for (i = 0; i < ARRAY_SIZE(where); i++) {
		data[where[i]] = 0x01;
		for (segs = 1; segs <= 3; segs++) {
			copy = dd_test_copy(pool,
					    &dd_test_bio(test, data, segs)->bio);
			KUNIT_EXPECT_FALSE_MSG(test, dd_data_is_zero(copy),
					       "byte %u, %u segments", where[i],
					       segs);
			dd_data_put(pool, copy);
		}
		data[where[i]] = 0;
	}
	dd_data_pool_exit(pool);
}

static void dd_data_test_equal(struct kunit *test)
{
	struct dd_data_pool *pool = dd_test_pool(test);
	u8 *data = kunit_kmalloc(test, DD_BLOCK_SIZE, GFP_KERNEL);
	struct page *a, *b;

	KUNIT_ASSERT_NOT_NULL(test, data);
	memset(data, 0x77, DD_BLOCK_SIZE);
	a = dd_test_copy(pool, &dd_test_bio(test, data, 1)->bio);
	b = dd_test_copy(pool, &dd_test_bio(test, data, 3)->bio);
	KUNIT_EXPECT_TRUE(test, dd_data_equal(a, b));
	dd_data_put(pool, b);
	data[DD_BLOCK_SIZE - 1] ^= 0x80;
	b = dd_test_copy(pool, &dd_test_bio(test, data, 2)->bio);
	KUNIT_EXPECT_FALSE(test, dd_data_equal(a, b));
	dd_data_put(pool, b);
	dd_data_put(pool, a);
	dd_data_pool_exit(pool);
}

/*
 * A stored block's copy kept for verify answers only for its own
 * physical block and its own tag: same bytes or other bytes. A later
 * block stored in the same slot replaces it, and a question with a newer
 * tag lets it go. The pool frees what it kept.
 */
static void dd_data_test_stored(struct kunit *test)
{
	struct dd_data_pool *pool = dd_test_pool(test);
	u8 *data = kunit_kmalloc(test, DD_BLOCK_SIZE, GFP_KERNEL);
	struct page *a, *b, *kept;
	u64 other = 5 + DD_DATA_STORED;

	KUNIT_ASSERT_NOT_NULL(test, data);
	memset(data, 0x5a, DD_BLOCK_SIZE);
	a = dd_test_copy(pool, &dd_test_bio(test, data, 1)->bio);
	KUNIT_EXPECT_EQ(test, dd_data_stored_compare(pool, 5, 1, a), DD_KEPT_NONE);
	kept = dd_test_copy(pool, &dd_test_bio(test, data, 2)->bio);
	dd_data_keep_stored(pool, 5, 1, kept);
	KUNIT_EXPECT_EQ(test, dd_data_stored_compare(pool, 5, 1, a), DD_KEPT_SAME);
	KUNIT_EXPECT_EQ(test, dd_data_stored_compare(pool, 6, 1, a), DD_KEPT_NONE);
	data[0] ^= 1;
	b = dd_test_copy(pool, &dd_test_bio(test, data, 3)->bio);
	KUNIT_EXPECT_EQ(test, dd_data_stored_compare(pool, 5, 1, b),
			DD_KEPT_DIFFERENT);
	/* The same slot: the newer block's copy replaces the older one's. */
	kept = dd_test_copy(pool, &dd_test_bio(test, data, 1)->bio);
	dd_data_keep_stored(pool, other, 1, kept);
	KUNIT_EXPECT_EQ(test, dd_data_stored_compare(pool, 5, 1, a), DD_KEPT_NONE);
	KUNIT_EXPECT_EQ(test, dd_data_stored_compare(pool, other, 1, b),
			DD_KEPT_SAME);
	KUNIT_EXPECT_EQ(test, dd_data_stored_compare(pool, other, 1, a),
			DD_KEPT_DIFFERENT);
	/* Asked with an older tag, it answers nothing and stays. */
	KUNIT_EXPECT_EQ(test, dd_data_stored_compare(pool, other, 0, b),
			DD_KEPT_NONE);
	KUNIT_EXPECT_NOT_NULL(test, pool->stored[other % DD_DATA_STORED].page);
	/* Asked with a newer tag, it is let go: an older one finds nothing. */
	KUNIT_EXPECT_EQ(test, dd_data_stored_compare(pool, other, 2, b),
			DD_KEPT_NONE);
	KUNIT_EXPECT_EQ(test, dd_data_stored_compare(pool, other, 1, b),
			DD_KEPT_NONE);
	KUNIT_EXPECT_NULL(test, pool->stored[other % DD_DATA_STORED].page);
	dd_data_put(pool, b);
	dd_data_put(pool, a);
	dd_data_pool_exit(pool);
}

/* One segment of a test bio: @len bytes at @offset of a page of its own. */
struct dd_test_seg {
	unsigned int len;
	unsigned int offset;
};

/*
 * Copies the blocks of a bio laid out as @segs, in pages whose other bytes
 * are not part of the write, and checks that each block gets its own bytes.
 */
static void dd_test_copy_layout(struct kunit *test,
				const struct dd_test_seg *segs,
				unsigned int nr_segs)
{
	const unsigned int nr = 3, size = nr * DD_BLOCK_SIZE;
	const size_t buf_size = (nr_segs + 1) * DD_BLOCK_SIZE;
	struct dd_data_pool *pool = dd_test_pool(test);
	u8 *data = kunit_kmalloc(test, size, GFP_KERNEL);
	u8 *bufs = kunit_kmalloc(test, buf_size, GFP_KERNEL);
	struct bio_vec bvec[5];
	struct page *pages[3];
	unsigned int i, off = 0;
	struct bio bio;
	u8 *p;

	KUNIT_ASSERT_NOT_NULL(test, data);
	KUNIT_ASSERT_NOT_NULL(test, bufs);
	KUNIT_ASSERT_LE(test, nr_segs, ARRAY_SIZE(bvec));
	for (i = 0; i < size; i++)
		data[i] = i * 7 + (i >> 12);
	memset(bufs, 0xee, buf_size);
	bio_init(&bio, NULL, bvec, ARRAY_SIZE(bvec), REQ_OP_WRITE);
	for (i = 0; i < nr_segs; i++) {
		p = PTR_ALIGN(bufs, DD_BLOCK_SIZE) + i * DD_BLOCK_SIZE +
		    segs[i].offset;
		memcpy(p, data + off, segs[i].len);
		__bio_add_page(&bio, virt_to_page(p), segs[i].len,
			       offset_in_page(p));
		off += segs[i].len;
	}
	KUNIT_ASSERT_EQ(test, bio.bi_iter.bi_size, size);
	dd_data_copy(pool, &bio, pages, nr);
	for (i = 0; i < nr; i++) {
		dd_test_expect_page(test, pages[i], data + i * DD_BLOCK_SIZE,
				    i);
		dd_data_put(pool, pages[i]);
	}
	dd_data_pool_exit(pool);
}

/*
 * Three blocks from segments that start and end inside blocks: 512 bytes
 * at the end of one page, then 3584-byte pieces from offset 512 of others,
 * so every later segment straddles two blocks.
 */
static void dd_data_test_copy_blocks(struct kunit *test)
{
	static const struct dd_test_seg segs[] = {
		{ 512, 3584 }, { 3584, 512 }, { 3584, 512 }, { 3584, 512 },
		{ 1024, 512 },
	};

	dd_test_copy_layout(test, segs, ARRAY_SIZE(segs));
}

/*
 * Whole aligned pages (copied by words) around a block made of the end of
 * one page and the aligned start of another (copied by bytes).
 */
static void dd_data_test_copy_mixed(struct kunit *test)
{
	static const struct dd_test_seg segs[] = {
		{ 4096, 0 }, { 3584, 512 }, { 512, 0 }, { 4096, 0 },
	};

	dd_test_copy_layout(test, segs, ARRAY_SIZE(segs));
}

static struct kunit_case dd_data_cases[] = {
	KUNIT_CASE(dd_data_test_copy),
	KUNIT_CASE(dd_data_test_copy_mixed),
	KUNIT_CASE(dd_data_test_copy_blocks),
	KUNIT_CASE(dd_data_test_zero),
	KUNIT_CASE(dd_data_test_equal),
	KUNIT_CASE(dd_data_test_stored),
	{}
};

static struct kunit_suite dd_data_suite = {
	.name = "dm_dedup_data",
	.test_cases = dd_data_cases,
};

kunit_test_suite(dd_data_suite);
