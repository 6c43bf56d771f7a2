// SPDX-License-Identifier: GPL-2.0-only
/*
 * KUnit tests of the metadata verbs (dedup-metadata.c) on a ram disk:
 * format and reopen, the map and refcounts, commit and abort, and what
 * activation accepts or refuses.
 */
#include <kunit/test.h>
#include <linux/string.h>
#include <linux/unaligned.h>

#include "dedup-metadata.h"
#include "dedup-reserve.h"
#include "dedup-test-util.h"

/* Byte offsets in the superblock, from Documentation/dedup-format.rst. */
#define DD_SB_OFF_VERSION	40
#define DD_SB_OFF_FLAGS		108
#define DD_SB_OFF_MAP_ROOT	112
#define DD_SB_OFF_REFCOUNT_ROOT	120
#define DD_SB_OFF_MAPPED	136
#define DD_SB_OFF_FORMAT_TIME	184
#define DD_SB_OFF_SAVED_ROOT	192
#define DD_SB_OFF_SAVED_WORDS	200
#define DD_SB_OFF_JOURNAL_START	208
#define DD_SB_OFF_JOURNAL_SEQ	224

/*
 * What the metadata reported: the blocks its verbs freed, the runs its
 * commits made reusable, what activation visited. One per test, in
 * test->priv, so that every helper records what the target would see.
 */
struct dd_test_events {
	unsigned int freed;
	u64 freed_pba[8];
	u8 freed_fp[8][DD_FP_SIZE];
	unsigned int reusable;
	u64 reusable_begin[8];
	u64 reusable_end[8];
	unsigned int visited;
	u64 visited_pba[8];
	u8 visited_fp[8][DD_FP_SIZE];
	/* what dd_test_verify says of the data of the newest append */
	unsigned int verified;
	u64 verified_pba[8];
	u64 data_seed[128];	/* what each data block holds: dd_test_fp(seed) */
	int verify_error;
};

static void dd_test_note_freed(struct kunit *test,
			       const struct dd_md_freed *f)
{
	struct dd_test_events *ev = test->priv;

	if (ev->freed < ARRAY_SIZE(ev->freed_pba)) {
		ev->freed_pba[ev->freed] = f->pba;
		memcpy(ev->freed_fp[ev->freed], f->fp, DD_FP_SIZE);
	}
	ev->freed++;
}

/* A verb's result with what it freed recorded: 1 becomes 0. */
static int dd_test_freed(struct kunit *test, int r,
			 const struct dd_md_freed *f)
{
	if (r == 1)
		dd_test_note_freed(test, f);
	KUNIT_EXPECT_LE(test, r, 1);
	return r > 0 ? 0 : r;
}

static void dd_test_on_reusable(void *ctx, u64 begin, u64 end)
{
	struct dd_test_events *ev = ctx;

	if (ev->reusable < ARRAY_SIZE(ev->reusable_begin)) {
		ev->reusable_begin[ev->reusable] = begin;
		ev->reusable_end[ev->reusable] = end;
	}
	ev->reusable++;
}

static int dd_test_visit(void *ctx, u64 pba, const u8 *fp)
{
	struct dd_test_events *ev = ctx;

	if (ev->visited < ARRAY_SIZE(ev->visited_pba)) {
		ev->visited_pba[ev->visited] = pba;
		memcpy(ev->visited_fp[ev->visited], fp, DD_FP_SIZE);
	}
	ev->visited++;
	return 0;
}

/* The data device, as the journal's newest append finds it. */
static int dd_test_verify(void *ctx, u64 pba, const u8 *fp)
{
	struct dd_test_events *ev = ctx;
	u8 want[DD_FP_SIZE];

	if (ev->verified < ARRAY_SIZE(ev->verified_pba))
		ev->verified_pba[ev->verified] = pba;
	ev->verified++;
	if (ev->verify_error)
		return ev->verify_error;
	if (pba >= ARRAY_SIZE(ev->data_seed))
		return 1;
	dd_test_fp(want, ev->data_seed[pba]);
	return memcmp(want, fp, DD_FP_SIZE) != 0;
}

static struct dd_md_config *dd_test_cfg(struct kunit *test, u64 logical,
					u64 data)
{
	struct dd_md_config *cfg = kunit_kzalloc(test, sizeof(*cfg),
						 GFP_KERNEL);
	struct dd_test_events *ev = kunit_kzalloc(test, sizeof(*ev),
						  GFP_KERNEL);

	KUNIT_ASSERT_NOT_NULL(test, cfg);
	KUNIT_ASSERT_NOT_NULL(test, ev);
	dd_test_md_config(cfg, logical, data);
	cfg->visit = dd_test_visit;
	cfg->ctx = ev;
	test->priv = ev;
	return cfg;
}

static struct dd_test_events *dd_test_ev(const struct dd_md_config *cfg)
{
	return cfg->ctx;
}

static int dd_test_try_open(struct block_device *bdev,
			    const struct dd_md_config *cfg, const char **error)
{
	struct dd_metadata *md = NULL;
	char *err = NULL;
	int r;

	r = dd_md_open(bdev, cfg, &md, &err);
	if (!r)
		dd_md_close(md);
	*error = err ?: "";
	return r;
}

static u64 dd_test_alloc(struct kunit *test, struct dd_metadata *md)
{
	u64 pba = U64_MAX, left = U64_MAX;

	KUNIT_ASSERT_EQ(test, dd_md_alloc_data(md, &pba, &left), 0);
	KUNIT_EXPECT_EQ(test, left, dd_md_free_data_blocks(md));
	return pba;
}

/* The verbs, with what they free recorded as the target would see it. */
static int dd_test_map_new(struct kunit *test, struct dd_metadata *md,
			   u64 lba, u64 pba, const u8 *fp)
{
	struct dd_md_freed f;

	return dd_test_freed(test, dd_md_map_new(md, lba, pba, fp, &f), &f);
}

/*
 * Share @pba under the fingerprint its record holds (none for a block out
 * of range: the verb's own answer is what counts).
 */
static int dd_test_map_dup(struct kunit *test, struct dd_metadata *md,
			   u64 lba, u64 pba)
{
	u8 fp[DD_FP_SIZE] = {};
	struct dd_md_freed f;

	dd_md_get_fingerprint(md, pba, fp);
	return dd_test_freed(test, dd_md_map_duplicate(md, lba, pba, fp, &f),
			     &f);
}

/* As dd_test_map_dup, the way the target shares: by fingerprint leaf. */
static int dd_test_share_known(struct kunit *test, struct dd_metadata *md,
			       u64 lba, u64 pba)
{
	u8 fp[DD_FP_SIZE] = {};
	struct dd_md_dup d = {
		.lba = lba, .leaf = pba / DD_FP_PER_LEAF,
		.fp = fp, .pba = U64_MAX,
	};
	struct dd_md_freed f;
	unsigned int done = 0;

	KUNIT_EXPECT_EQ(test, dd_md_get_fingerprint(md, pba, fp), 0);
	dd_md_map_duplicates(md, &d, 1, &done, &f);
	KUNIT_EXPECT_EQ(test, done, 1);
	if (d.r >= 0)
		KUNIT_EXPECT_EQ(test, d.pba, pba);
	return dd_test_freed(test, d.r, &f);
}

static int dd_test_map_zero(struct kunit *test, struct dd_metadata *md,
			    u64 lba)
{
	struct dd_md_freed f;

	return dd_test_freed(test, dd_md_map_zero(md, lba, &f), &f);
}

/* The whole of [begin, end), as the target loops over it; *n unmapped. */
static int dd_test_unmap(struct kunit *test, struct dd_metadata *md,
			 u64 begin, u64 end, u64 *n)
{
	struct dd_md_freed f[3];
	unsigned int nr, i;
	u64 next = begin;
	int r;

	*n = 0;
	do {
		r = dd_md_unmap_range(md, next, end, f, ARRAY_SIZE(f), &nr,
				      &next, n);
		KUNIT_EXPECT_LE(test, nr, ARRAY_SIZE(f));
		for (i = 0; i < nr; i++)
			dd_test_note_freed(test, &f[i]);
	} while (!r && next < end);
	KUNIT_EXPECT_TRUE(test, r || next == end);
	return r;
}

static int dd_test_commit(struct kunit *test, struct dd_metadata *md)
{
	return dd_md_commit(md, dd_test_on_reusable, test->priv);
}

/* A unique write: a new physical block with content @seed for @lba. */
static u64 dd_test_write(struct kunit *test, struct dd_metadata *md, u64 lba,
			 u64 seed)
{
	u8 fp[DD_FP_SIZE];
	u64 pba = dd_test_alloc(test, md);

	dd_test_fp(fp, seed);
	KUNIT_ASSERT_EQ(test, dd_test_map_new(test, md, lba, pba, fp), 0);
	return pba;
}

/* A duplicate write: @lba shares @pba. */
static void dd_test_share(struct kunit *test, struct dd_metadata *md, u64 lba,
			  u64 pba)
{
	KUNIT_ASSERT_EQ(test, dd_test_map_dup(test, md, lba, pba), 0);
}

static void dd_test_expect_map(struct kunit *test, struct dd_metadata *md,
			       u64 lba, u64 pba)
{
	u64 got = U64_MAX;

	KUNIT_EXPECT_EQ_MSG(test, dd_md_lookup(md, lba, &got, false), 0,
			    "lba %llu", lba);
	KUNIT_EXPECT_EQ_MSG(test, got, pba, "lba %llu", lba);
}

static void dd_test_expect_unmapped(struct kunit *test, struct dd_metadata *md,
				    u64 lba)
{
	u64 got;

	KUNIT_EXPECT_EQ_MSG(test, dd_md_lookup(md, lba, &got, false), -ENODATA,
			    "lba %llu", lba);
}

static u32 dd_test_refcount(struct kunit *test, struct dd_metadata *md,
			    u64 pba)
{
	u32 rc = U32_MAX - 7;

	KUNIT_EXPECT_EQ(test, dd_md_get_refcount(md, pba, &rc), 0);
	return rc;
}

static void dd_test_expect_fp(struct kunit *test, struct dd_metadata *md,
			      u64 pba, u64 seed)
{
	u8 want[DD_FP_SIZE], got[DD_FP_SIZE];

	dd_test_fp(want, seed);
	KUNIT_ASSERT_EQ(test, dd_md_get_fingerprint(md, pba, got), 0);
	KUNIT_EXPECT_MEMEQ_MSG(test, got, want, DD_FP_SIZE, "pba %llu", pba);
}

static struct dd_md_stats dd_test_stats(struct dd_metadata *md)
{
	struct dd_md_stats st;

	dd_md_stats(md, &st);
	return st;
}

/* A refused change left no trace: same statistics, transaction still clean. */
static void dd_test_expect_untouched(struct kunit *test, struct dd_metadata *md,
				     const struct dd_md_stats *before)
{
	struct dd_md_stats now = dd_test_stats(md);

	KUNIT_EXPECT_MEMEQ(test, &now, before, sizeof(now));
	KUNIT_EXPECT_FALSE(test, dd_md_dirty(md));
}

/* The slot holding the superblock with the highest generation. */
static u64 dd_test_sb_slot(struct kunit *test, struct block_device *bdev,
			   u8 *raw)
{
	u64 gen[DD_SB_SLOTS] = {}, slot;

	for (slot = 0; slot < DD_SB_SLOTS; slot++) {
		dd_test_read_block(test, bdev, slot, raw);
		if (dd_block_csum_ok(raw))
			gen[slot] = get_unaligned_le64(raw + 16);
	}
	KUNIT_ASSERT_NE(test, gen[0] + gen[1], 0);
	slot = gen[1] > gen[0];
	dd_test_read_block(test, bdev, slot, raw);
	return slot;
}

/*
 * Change the committed metadata of a closed device behind the kernel's
 * back, with a valid checksum: @size bytes at @offset of the payload of
 * the array whose root the superblock keeps at @root_off. The root must
 * be a leaf (a small array).
 */
static void dd_test_patch_leaf(struct kunit *test, struct block_device *bdev,
			       unsigned int root_off, unsigned int offset,
			       u64 value, unsigned int size)
{
	u8 *sb = kunit_kmalloc(test, DD_BLOCK_SIZE, GFP_KERNEL);
	u8 *leaf = kunit_kmalloc(test, DD_BLOCK_SIZE, GFP_KERNEL);
	u64 root;

	KUNIT_ASSERT_NOT_NULL(test, sb);
	KUNIT_ASSERT_NOT_NULL(test, leaf);
	dd_test_sb_slot(test, bdev, sb);
	root = get_unaligned_le64(sb + root_off);
	KUNIT_ASSERT_NE(test, root, 0);
	dd_test_read_block(test, bdev, root, leaf);
	KUNIT_ASSERT_EQ(test, get_unaligned_le32(leaf + 4), DD_BT_LEAF);
	if (size == 4)
		put_unaligned_le32(value, leaf + DD_HEADER_SIZE + offset);
	else
		put_unaligned_le64(value, leaf + DD_HEADER_SIZE + offset);
	put_unaligned_le32(dd_block_csum(leaf), leaf);
	dd_test_write_block(test, bdev, root, leaf);
	kunit_kfree(test, sb);
	kunit_kfree(test, leaf);
}

/* The same for a field of the newest superblock. */
static void dd_test_patch_sb(struct kunit *test, struct block_device *bdev,
			     unsigned int offset, u64 value, unsigned int size)
{
	u8 *sb = kunit_kmalloc(test, DD_BLOCK_SIZE, GFP_KERNEL);
	u64 slot;

	KUNIT_ASSERT_NOT_NULL(test, sb);
	slot = dd_test_sb_slot(test, bdev, sb);
	if (size == 4)
		put_unaligned_le32(value, sb + offset);
	else
		put_unaligned_le64(value, sb + offset);
	put_unaligned_le32(dd_block_csum(sb), sb);
	dd_test_write_block(test, bdev, slot, sb);
	kunit_kfree(test, sb);
}

/*
 * Formatting writes exactly the superblock of the documentation's
 * example, up to the time of day.
 */
static void dd_md_test_format(struct kunit *test)
{
	struct block_device *bdev = dd_test_dev_open(test);
	struct dd_md_config *cfg = dd_test_cfg(test, 65536, 16384);
	struct dd_metadata *md = dd_test_md_open(test, bdev, cfg);
	struct dd_md_stats st = dd_test_stats(md);
	u8 *raw = kunit_kmalloc(test, DD_BLOCK_SIZE, GFP_KERNEL);

	KUNIT_ASSERT_NOT_NULL(test, raw);
	KUNIT_EXPECT_EQ(test, st.transaction_id, 1);
	KUNIT_EXPECT_EQ(test, st.metadata_total, DD_TEST_DEV_BLOCKS);
	/* a quarter of what the trees need: (2 + 2 * (131 + 18 + 131)) / 4 */
	KUNIT_EXPECT_EQ(test, st.journal_total, 140);
	KUNIT_EXPECT_EQ(test, st.metadata_used, DD_FIRST_TREE_BLOCK + 140);
	KUNIT_EXPECT_EQ(test, st.data_total, 16384);
	KUNIT_EXPECT_EQ(test, st.data_used, 0);
	KUNIT_EXPECT_EQ(test, st.mapped, 0);
	KUNIT_EXPECT_FALSE(test, dd_md_dirty(md));
	KUNIT_EXPECT_EQ(test, dd_md_free_data_blocks(md), 16384);

	dd_test_read_block(test, bdev, 0, raw);
	KUNIT_EXPECT_NULL(test, memchr_inv(raw, 0, DD_BLOCK_SIZE));
	dd_test_read_block(test, bdev, 1, raw);
	KUNIT_EXPECT_TRUE(test, dd_block_csum_ok(raw));
	/*
	 * Version 2 is the example (version 1) with a journal after the
	 * trees' slots, whose appends may be written unflushed.
	 */
	KUNIT_EXPECT_EQ(test, get_unaligned_le32(raw + DD_SB_OFF_VERSION), 2);
	KUNIT_EXPECT_EQ(test, get_unaligned_le32(raw + DD_SB_OFF_FLAGS),
			DD_SB_UNFLUSHED_APPENDS);
	put_unaligned_le32(0, raw + DD_SB_OFF_FLAGS);
	KUNIT_EXPECT_EQ(test, get_unaligned_le64(raw + DD_SB_OFF_JOURNAL_START),
			DD_FIRST_TREE_BLOCK);
	KUNIT_EXPECT_EQ(test, get_unaligned_le64(raw + 216), 140);
	KUNIT_EXPECT_NE(test, get_unaligned_le64(raw + 232), 0);
	put_unaligned_le32(1, raw + DD_SB_OFF_VERSION);
	memset(raw + DD_SB_OFF_JOURNAL_START, 0, 32);
	KUNIT_EXPECT_GT(test, get_unaligned_le64(raw + DD_SB_OFF_FORMAT_TIME),
			1700000000);
	put_unaligned_le64(1795316469, raw + DD_SB_OFF_FORMAT_TIME);
	KUNIT_EXPECT_EQ(test, dd_block_csum(raw), 0xD6818B5A);
	put_unaligned_le32(dd_block_csum(raw), raw);
	KUNIT_EXPECT_MEMEQ(test, raw, dd_test_example_sb, 192);
	KUNIT_EXPECT_NULL(test, memchr_inv(raw + 192, 0, DD_BLOCK_SIZE - 192));

	/* a commit without changes writes nothing */
	KUNIT_EXPECT_EQ(test, dd_test_commit(test, md), 0);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).transaction_id, 1);
	dd_test_read_block(test, bdev, 0, raw);
	KUNIT_EXPECT_NULL(test, memchr_inv(raw, 0, DD_BLOCK_SIZE));
}

/* What the kernel refuses to open, and that it then writes nothing. */
static void dd_md_test_open_refused(struct kunit *test)
{
	struct block_device *bdev = dd_test_dev_open(test);
	struct dd_md_config *cfg = dd_test_cfg(test, 1000, 100);
	u8 *raw = kunit_kmalloc(test, DD_BLOCK_SIZE, GFP_KERNEL);
	const char *error;

	KUNIT_ASSERT_NOT_NULL(test, raw);
	cfg->logical_blocks = 4000000;
	KUNIT_EXPECT_GT(test, dd_md_required_blocks(4000000, 100),
			DD_TEST_DEV_BLOCKS);
	KUNIT_EXPECT_EQ(test, dd_test_try_open(bdev, cfg, &error), -EINVAL);
	KUNIT_EXPECT_STREQ(test, error, "metadata device too small");

	cfg->logical_blocks = 1000;
	cfg->read_only = true;
	KUNIT_EXPECT_EQ(test, dd_test_try_open(bdev, cfg, &error), -EINVAL);
	KUNIT_EXPECT_NOT_NULL(test, strstr(error, "read-only"));
	cfg->read_only = false;
	dd_test_read_block(test, bdev, 1, raw);
	KUNIT_EXPECT_NULL(test, memchr_inv(raw, 0, DD_BLOCK_SIZE));

	/* something else's data is never formatted over */
	memset(raw, 0xab, DD_BLOCK_SIZE);
	dd_test_write_block(test, bdev, 0, raw);
	KUNIT_EXPECT_EQ(test, dd_test_try_open(bdev, cfg, &error), -EINVAL);
	KUNIT_EXPECT_NOT_NULL(test, strstr(error, "refusing to format"));
	dd_test_read_block(test, bdev, 1, raw);
	KUNIT_EXPECT_NULL(test, memchr_inv(raw, 0, DD_BLOCK_SIZE));
}

/* Reopening checks the table against the superblock, field by field. */
static void dd_md_test_identity(struct kunit *test)
{
	struct block_device *bdev = dd_test_dev_open(test);
	struct dd_md_config *cfg = dd_test_cfg(test, 1000, 100);
	struct dd_metadata *md = dd_test_md_open(test, bdev, cfg);
	const char *error;

	dd_test_write(test, md, 3, 3);
	KUNIT_ASSERT_EQ(test, dd_test_commit(test, md), 0);
	dd_test_md_close(test, md);

	/* a larger table grows the device (dd_md_test_grow); a smaller one */
	cfg->logical_blocks = 999;
	KUNIT_EXPECT_EQ(test, dd_test_try_open(bdev, cfg, &error), -EINVAL);
	KUNIT_EXPECT_NOT_NULL(test, strstr(error, "logical_blocks"));
	KUNIT_EXPECT_NOT_NULL(test, strstr(error, "cannot shrink"));
	cfg->logical_blocks = 1000;
	cfg->data_blocks = 99;
	KUNIT_EXPECT_EQ(test, dd_test_try_open(bdev, cfg, &error), -EINVAL);
	KUNIT_EXPECT_NOT_NULL(test, strstr(error, "data_blocks"));
	cfg->data_blocks = 100;
	/* read_only never writes, so it cannot grow */
	cfg->read_only = true;
	cfg->data_blocks = 101;
	KUNIT_EXPECT_EQ(test, dd_test_try_open(bdev, cfg, &error), -EINVAL);
	KUNIT_EXPECT_NOT_NULL(test, strstr(error, "read-only"));
	cfg->read_only = false;
	cfg->data_blocks = 100;
	cfg->hash_name = "sha512";
	KUNIT_EXPECT_EQ(test, dd_test_try_open(bdev, cfg, &error), -EINVAL);
	KUNIT_EXPECT_NOT_NULL(test, strstr(error, "hash"));
	cfg->hash_name = "sha256";
	cfg->fp_size = 16;
	KUNIT_EXPECT_EQ(test, dd_test_try_open(bdev, cfg, &error), -EINVAL);
	KUNIT_EXPECT_NOT_NULL(test, strstr(error, "hash"));
	cfg->fp_size = DD_FP_SIZE;

	/*
	 * identity_only stops before activation, but after the check, and
	 * allocates no data allocator (a reload's table has one live).
	 */
	cfg->identity_only = true;
	KUNIT_EXPECT_EQ(test, dd_test_try_open(bdev, cfg, &error), 0);
	KUNIT_EXPECT_EQ(test, dd_test_ev(cfg)->visited, 0);
	{
		struct dd_md_stats st;
		char *err = NULL;

		KUNIT_ASSERT_EQ(test, dd_md_open(bdev, cfg, &md, &err), 0);
		dd_md_stats(md, &st);
		KUNIT_EXPECT_EQ(test, st.data_space_bytes, 0);
		dd_md_close(md);
	}
	cfg->logical_blocks = 7;
	KUNIT_EXPECT_EQ(test, dd_test_try_open(bdev, cfg, &error), -EINVAL);
	cfg->logical_blocks = 1000;
	cfg->identity_only = false;

	md = dd_test_md_open(test, bdev, cfg);
	dd_test_expect_map(test, md, 3, 0);
	KUNIT_EXPECT_EQ(test, dd_test_ev(cfg)->visited, 1);
	dd_test_md_close(test, md);

	dd_test_patch_sb(test, bdev, DD_SB_OFF_VERSION, 3, 4);
	KUNIT_EXPECT_EQ(test, dd_test_try_open(bdev, cfg, &error), -EINVAL);
	KUNIT_EXPECT_STREQ(test, error,
			   "metadata format version not supported");
}

/*
 * Map, share, look up, commit and reopen, at the edges: LBA 0 and the
 * last LBA, PBA 0 and the last PBA. Reopening must rebuild the same
 * accounting from the trees and report every live block once.
 */
static void dd_md_test_map_reopen(struct kunit *test)
{
	struct block_device *bdev = dd_test_dev_open(test);
	struct dd_md_config *cfg = dd_test_cfg(test, 1000, 8);
	struct dd_metadata *md = dd_test_md_open(test, bdev, cfg);
	struct dd_test_events *ev = dd_test_ev(cfg);
	struct dd_md_stats st, st2;
	u64 pba[8], got, left;
	unsigned int i;
	u32 rc;
	u8 fp[DD_FP_SIZE];

	for (i = 0; i < 8; i++)
		pba[i] = dd_test_alloc(test, md);
	KUNIT_EXPECT_EQ(test, pba[0], 0);
	KUNIT_EXPECT_EQ(test, pba[7], 7);
	KUNIT_EXPECT_EQ(test, dd_md_alloc_data(md, &got, &left), -ENOSPC);
	/* failed writes give their blocks back at once */
	for (i = 1; i < 7; i++)
		dd_md_free_data_now(md, pba[i]);
	KUNIT_EXPECT_EQ(test, dd_md_free_data_blocks(md), 6);

	dd_test_fp(fp, 100);
	KUNIT_ASSERT_EQ(test, dd_test_map_new(test, md, 0, 0, fp), 0);
	dd_test_fp(fp, 107);
	KUNIT_ASSERT_EQ(test, dd_test_map_new(test, md, 999, 7, fp), 0);
	dd_test_share(test, md, 500, 0);
	KUNIT_EXPECT_TRUE(test, dd_md_dirty(md));

	dd_test_expect_map(test, md, 0, 0);
	dd_test_expect_map(test, md, 500, 0);
	dd_test_expect_map(test, md, 999, 7);
	dd_test_expect_unmapped(test, md, 1);
	dd_test_expect_unmapped(test, md, 998);
	KUNIT_EXPECT_EQ(test, dd_md_lookup(md, 1000, &got, false), -ERANGE);
	KUNIT_EXPECT_EQ(test, dd_test_refcount(test, md, 0), 2);
	KUNIT_EXPECT_EQ(test, dd_test_refcount(test, md, 7), 1);
	KUNIT_EXPECT_EQ(test, dd_test_refcount(test, md, 3), 0);
	KUNIT_EXPECT_EQ(test, dd_md_get_refcount(md, 8, &rc), -ERANGE);
	dd_test_expect_fp(test, md, 0, 100);
	dd_test_expect_fp(test, md, 7, 107);

	st = dd_test_stats(md);
	KUNIT_EXPECT_EQ(test, st.mapped, 3);
	KUNIT_EXPECT_EQ(test, st.data_live, 2);
	KUNIT_EXPECT_EQ(test, st.data_used, 2);
	KUNIT_EXPECT_EQ(test, st.unique_writes, 2);
	KUNIT_EXPECT_EQ(test, st.duplicate_writes, 1);
	KUNIT_EXPECT_EQ(test, st.transaction_id, 1);

	KUNIT_ASSERT_EQ(test, dd_test_commit(test, md), 0);
	KUNIT_EXPECT_FALSE(test, dd_md_dirty(md));
	st = dd_test_stats(md);
	KUNIT_EXPECT_EQ(test, st.transaction_id, 2);
	dd_test_md_close(test, md);

	md = dd_test_md_open(test, bdev, cfg);
	st2 = dd_test_stats(md);
	/* the load writes the state it loaded once more, as the next id */
	st.transaction_id++;
	st.checkpoints = st2.checkpoints;
	KUNIT_EXPECT_MEMEQ(test, &st2, &st, sizeof(st));
	dd_test_expect_map(test, md, 0, 0);
	dd_test_expect_map(test, md, 500, 0);
	dd_test_expect_map(test, md, 999, 7);
	dd_test_expect_unmapped(test, md, 1);
	KUNIT_EXPECT_EQ(test, dd_test_refcount(test, md, 0), 2);
	dd_test_expect_fp(test, md, 7, 107);

	/* the index is rebuilt from exactly the live blocks */
	KUNIT_ASSERT_EQ(test, ev->visited, 2);
	KUNIT_EXPECT_EQ(test, ev->visited_pba[0], 0);
	KUNIT_EXPECT_EQ(test, ev->visited_pba[1], 7);
	dd_test_fp(fp, 100);
	KUNIT_EXPECT_MEMEQ(test, ev->visited_fp[0], fp, DD_FP_SIZE);
	/* and what is free after a reopen is what was free before */
	KUNIT_EXPECT_EQ(test, dd_test_alloc(test, md), 1);
}

/*
 * A block whose last reference goes stays allocated until the commit
 * after the one that freed it, even when the data device is full; then
 * it becomes reusable and the target hears about it.
 */
static void dd_md_test_free_after_commit(struct kunit *test)
{
	struct block_device *bdev = dd_test_dev_open(test);
	struct dd_md_config *cfg = dd_test_cfg(test, 16, 4);
	struct dd_metadata *md = dd_test_md_open(test, bdev, cfg);
	struct dd_test_events *ev = dd_test_ev(cfg);
	u8 fp[DD_FP_SIZE];
	u64 lba, pba, left;

	for (lba = 0; lba < 4; lba++)
		KUNIT_ASSERT_EQ(test, dd_test_write(test, md, lba, lba), lba);
	KUNIT_ASSERT_EQ(test, dd_test_commit(test, md), 0);
	KUNIT_EXPECT_EQ(test, dd_md_free_data_blocks(md), 0);

	KUNIT_ASSERT_EQ(test, dd_test_map_zero(test, md, 0), 0);
	dd_test_expect_unmapped(test, md, 0);
	KUNIT_EXPECT_EQ(test, dd_test_refcount(test, md, 0), 0);
	KUNIT_ASSERT_EQ(test, ev->freed, 1);
	KUNIT_EXPECT_EQ(test, ev->freed_pba[0], 0);
	dd_test_fp(fp, 0);
	KUNIT_EXPECT_MEMEQ(test, ev->freed_fp[0], fp, DD_FP_SIZE);
	KUNIT_EXPECT_EQ(test, dd_md_pending_data_frees(md), 1);
	KUNIT_EXPECT_EQ(test, dd_md_free_data_blocks(md), 0);
	KUNIT_EXPECT_EQ(test, dd_md_alloc_data(md, &pba, &left), -EAGAIN);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).data_live, 3);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).data_used, 4);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).zero_writes, 1);
	KUNIT_EXPECT_EQ(test, ev->reusable, 0);

	/*
	 * Committed, but the commit in the other superblock slot still maps
	 * lba 0 to the block: it cools until one more commit, which the
	 * device asks for although nothing else changed.
	 */
	KUNIT_ASSERT_EQ(test, dd_test_commit(test, md), 0);
	KUNIT_EXPECT_EQ(test, ev->reusable, 0);
	KUNIT_EXPECT_EQ(test, dd_md_pending_data_frees(md), 0);
	KUNIT_EXPECT_EQ(test, dd_md_data_reusable_at_commit(md), 1);
	KUNIT_EXPECT_EQ(test, dd_md_free_data_blocks(md), 0);
	KUNIT_EXPECT_EQ(test, dd_md_alloc_data(md, &pba, &left), -EAGAIN);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).pending_free, 1);
	KUNIT_EXPECT_TRUE(test, dd_md_dirty(md));

	KUNIT_ASSERT_EQ(test, dd_test_commit(test, md), 0);
	KUNIT_ASSERT_EQ(test, ev->reusable, 1);
	KUNIT_EXPECT_EQ(test, ev->reusable_begin[0], 0);
	KUNIT_EXPECT_EQ(test, ev->reusable_end[0], 1);
	KUNIT_EXPECT_EQ(test, dd_md_data_reusable_at_commit(md), 0);
	KUNIT_EXPECT_EQ(test, dd_md_free_data_blocks(md), 1);
	KUNIT_EXPECT_FALSE(test, dd_md_dirty(md));

	/* an overwrite: the new block comes from the freed one */
	pba = dd_test_write(test, md, 1, 50);
	KUNIT_EXPECT_EQ(test, pba, 0);
	KUNIT_ASSERT_EQ(test, ev->freed, 2);
	KUNIT_EXPECT_EQ(test, ev->freed_pba[1], 1);
	dd_test_expect_map(test, md, 1, 0);
	dd_test_expect_fp(test, md, 0, 50);
	KUNIT_EXPECT_EQ(test, dd_md_alloc_data(md, &pba, &left), -EAGAIN);
	KUNIT_ASSERT_EQ(test, dd_test_commit(test, md), 0);
	KUNIT_EXPECT_EQ(test, dd_md_alloc_data(md, &pba, &left), -EAGAIN);
	KUNIT_ASSERT_EQ(test, dd_test_commit(test, md), 0);
	KUNIT_EXPECT_EQ(test, ev->reusable, 2);
	KUNIT_EXPECT_EQ(test, dd_test_alloc(test, md), 1);
	dd_md_free_data_now(md, 1);

	dd_test_md_close(test, md);
	md = dd_test_md_open(test, bdev, cfg);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).data_used, 3);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).mapped, 3);
	dd_test_expect_map(test, md, 1, 0);
	dd_test_expect_unmapped(test, md, 0);
}

/*
 * Rewriting a logical block with the content it already holds: the
 * target maps the block it found again. The reference is taken before
 * the old mapping's is dropped, so nothing changes but the count of
 * duplicate writes; in particular the block is not freed in between.
 */
static void dd_md_test_rewrite_same(struct kunit *test)
{
	struct block_device *bdev = dd_test_dev_open(test);
	struct dd_md_config *cfg = dd_test_cfg(test, 100, 100);
	struct dd_metadata *md = dd_test_md_open(test, bdev, cfg);
	struct dd_test_events *ev = dd_test_ev(cfg);
	u64 pba;

	pba = dd_test_write(test, md, 0, 1);
	KUNIT_ASSERT_EQ(test, dd_test_commit(test, md), 0);
	KUNIT_ASSERT_EQ(test, dd_test_map_dup(test, md, 0, pba), 0);
	dd_test_expect_map(test, md, 0, pba);
	KUNIT_EXPECT_EQ(test, dd_test_refcount(test, md, pba), 1);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).mapped, 1);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).data_live, 1);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).duplicate_writes, 1);
	KUNIT_EXPECT_EQ(test, dd_md_pending_data_frees(md), 0);
	KUNIT_EXPECT_EQ(test, ev->freed, 0);
	KUNIT_ASSERT_EQ(test, dd_test_commit(test, md), 0);
	dd_test_md_close(test, md);
	md = dd_test_md_open(test, bdev, cfg);
	KUNIT_EXPECT_EQ(test, dd_test_refcount(test, md, pba), 1);

	/* the same for a block that another logical block shares */
	dd_test_share(test, md, 1, pba);
	KUNIT_ASSERT_EQ(test, dd_test_map_dup(test, md, 1, pba), 0);
	dd_test_expect_map(test, md, 1, pba);
	KUNIT_EXPECT_EQ(test, dd_test_refcount(test, md, pba), 2);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).mapped, 2);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).data_live, 1);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).duplicate_writes, 3);
	KUNIT_EXPECT_EQ(test, dd_md_pending_data_frees(md), 0);
	KUNIT_EXPECT_EQ(test, ev->freed, 0);
}

/*
 * Metadata blocks follow the same rule: a change copies the path to the
 * entry, the originals are freed by the commit, and the count after a
 * reopen (rebuilt by walking the trees) equals the running count.
 */
static void dd_md_test_metadata_blocks(struct kunit *test)
{
	struct block_device *bdev = dd_test_dev_open(test);
	struct dd_md_config *cfg = dd_test_cfg(test, 2000, 2000);
	struct dd_metadata *md = dd_test_md_open(test, bdev, cfg);
	u64 used, pba;

	pba = dd_test_write(test, md, 0, 1);
	dd_test_write(test, md, 1999, 2);
	KUNIT_ASSERT_EQ(test, dd_test_commit(test, md), 0);
	used = dd_test_stats(md).metadata_used;
	/* three arrays of height 1: map root and leaves 0 and 3, two more */
	KUNIT_EXPECT_EQ(test, used, DD_FIRST_TREE_BLOCK + 3 + 2 + 2 +
			dd_test_stats(md).journal_total);

	/* refcount root and leaf, map root and leaf */
	dd_test_share(test, md, 1, pba);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).metadata_used, used + 4);
	dd_test_share(test, md, 2, pba);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).metadata_used, used + 4);
	KUNIT_ASSERT_EQ(test, dd_test_commit(test, md), 0);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).metadata_used, used);

	dd_test_md_close(test, md);
	md = dd_test_md_open(test, bdev, cfg);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).metadata_used, used);
	KUNIT_EXPECT_EQ(test, dd_test_refcount(test, md, pba), 3);
}

/* After an abort the device is the last commit, and stays so. */
/* A checksum of every block of the device, read past any cache. */
static void dd_test_device_crcs(struct kunit *test, struct block_device *bdev,
				u32 *crcs)
{
	u8 *raw = kunit_kmalloc(test, DD_BLOCK_SIZE, GFP_KERNEL);
	u64 nr;

	KUNIT_ASSERT_NOT_NULL(test, raw);
	for (nr = 0; nr < DD_TEST_DEV_BLOCKS; nr++) {
		dd_test_read_block(test, bdev, nr, raw);
		crcs[nr] = dd_test_crc32c(raw, DD_BLOCK_SIZE);
	}
	kunit_kfree(test, raw);
}

static void dd_md_test_abort(struct kunit *test)
{
	struct block_device *bdev = dd_test_dev_open(test);
	struct dd_md_config *cfg = dd_test_cfg(test, 1000, 100);
	struct dd_metadata *md = dd_test_md_open(test, bdev, cfg);
	u32 (*crcs)[DD_TEST_DEV_BLOCKS];
	struct dd_md_stats st;
	u64 pba0, pba1, n, got;
	u8 fp[DD_FP_SIZE];

	crcs = kunit_kmalloc(test, 2 * sizeof(*crcs), GFP_KERNEL);
	KUNIT_ASSERT_NOT_NULL(test, crcs);
	pba0 = dd_test_write(test, md, 0, 10);
	pba1 = dd_test_write(test, md, 1, 11);
	dd_test_share(test, md, 2, pba0);
	KUNIT_ASSERT_EQ(test, dd_test_commit(test, md), 0);
	st = dd_test_stats(md);

	dd_test_write(test, md, 0, 20);
	dd_test_share(test, md, 3, pba1);
	dd_test_write(test, md, 999, 21);
	KUNIT_ASSERT_EQ(test, dd_test_unmap(test, md, 1, 3, &n), 0);
	KUNIT_EXPECT_EQ(test, n, 2);
	dd_md_abort(md);

	dd_test_expect_map(test, md, 0, pba0);
	dd_test_expect_map(test, md, 1, pba1);
	dd_test_expect_map(test, md, 2, pba0);
	dd_test_expect_unmapped(test, md, 3);
	dd_test_expect_unmapped(test, md, 999);
	KUNIT_EXPECT_EQ(test, dd_test_refcount(test, md, pba0), 2);
	KUNIT_EXPECT_EQ(test, dd_test_refcount(test, md, pba1), 1);
	dd_test_expect_fp(test, md, pba0, 10);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).mapped, st.mapped);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).data_live, st.data_live);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).unique_writes,
			st.unique_writes);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).duplicate_writes,
			st.duplicate_writes);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).discarded, st.discarded);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).transaction_id,
			st.transaction_id);
	KUNIT_EXPECT_FALSE(test, dd_md_dirty(md));

	dd_test_fp(fp, 30);
	KUNIT_EXPECT_EQ(test, dd_md_alloc_data(md, &got, &n), -EROFS);
	KUNIT_EXPECT_EQ(test, dd_test_map_new(test, md, 5, 50, fp), -EROFS);
	KUNIT_EXPECT_EQ(test, dd_test_map_zero(test, md, 0), -EROFS);
	KUNIT_EXPECT_EQ(test, dd_test_map_dup(test, md, 4, pba0), -EROFS);
	/* dropping a reference, as unmapping does */
	KUNIT_EXPECT_EQ(test, dd_test_map_zero(test, md, 2), -EROFS);
	KUNIT_EXPECT_EQ(test, dd_test_unmap(test, md, 0, 10, &n), -EROFS);
	KUNIT_EXPECT_EQ(test, dd_test_commit(test, md), -EROFS);
	dd_test_expect_map(test, md, 0, pba0);
	/*
	 * Nothing of the dead transaction is left to write: closing (what a
	 * reloaded table's destructor does, after the new table opened the
	 * device) must not change a single block.
	 */
	dd_test_device_crcs(test, bdev, crcs[0]);
	dd_test_md_close(test, md);
	dd_test_device_crcs(test, bdev, crcs[1]);
	KUNIT_EXPECT_MEMEQ(test, crcs[0], crcs[1],
			   DD_TEST_DEV_BLOCKS * sizeof(u32));

	md = dd_test_md_open(test, bdev, cfg);
	dd_test_expect_map(test, md, 0, pba0);
	dd_test_expect_map(test, md, 2, pba0);
	dd_test_expect_unmapped(test, md, 3);
	dd_test_expect_unmapped(test, md, 999);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).mapped, st.mapped);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).data_used, st.data_used);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).metadata_used,
			st.metadata_used);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).transaction_id,
			st.transaction_id + 1);
}

/*
 * A refcount saturates at U32_MAX: one more reference is refused with
 * -EOVERFLOW and the count stays, so that it can never wrap to 0 and
 * free a block that 2^32 logical blocks still map (the target then
 * stores the data again instead). The refusal leaves no trace, not even
 * a dirty transaction. Getting there takes a refcount the tests write
 * onto the device: 4 billion writes are not an option.
 */
static void dd_md_test_refcount_max(struct kunit *test)
{
	struct block_device *bdev = dd_test_dev_open(test);
	struct dd_md_config *cfg = dd_test_cfg(test, 100, 100);
	struct dd_metadata *md = dd_test_md_open(test, bdev, cfg);
	struct dd_test_events *ev = dd_test_ev(cfg);
	struct dd_md_stats st;
	u64 pba;

	pba = dd_test_write(test, md, 0, 1);
	KUNIT_ASSERT_EQ(test, pba, 0);
	dd_test_write(test, md, 1, 2);
	KUNIT_ASSERT_EQ(test, dd_test_commit(test, md), 0);
	dd_test_md_close(test, md);

	dd_test_patch_leaf(test, bdev, DD_SB_OFF_REFCOUNT_ROOT, 0,
			   U32_MAX - 1, 4);
	/* activation checks the sum of refcounts: U32_MAX - 1 plus 1 */
	dd_test_patch_sb(test, bdev, DD_SB_OFF_MAPPED, U32_MAX, 8);
	md = dd_test_md_open(test, bdev, cfg);
	KUNIT_EXPECT_EQ(test, dd_test_refcount(test, md, 0), U32_MAX - 1);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).mapped, (u64)U32_MAX);

	/* the last reference below saturation is taken and used */
	KUNIT_ASSERT_EQ(test, dd_test_map_dup(test, md, 2, 0), 0);
	KUNIT_EXPECT_EQ(test, dd_test_refcount(test, md, 0), U32_MAX);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).mapped, (u64)U32_MAX + 1);
	KUNIT_EXPECT_EQ(test, dd_test_map_dup(test, md, 3, 0), -EOVERFLOW);
	KUNIT_EXPECT_EQ(test, dd_test_refcount(test, md, 0), U32_MAX);
	dd_test_expect_unmapped(test, md, 3);
	KUNIT_ASSERT_EQ(test, dd_test_commit(test, md), 0);
	dd_test_md_close(test, md);

	md = dd_test_md_open(test, bdev, cfg);
	KUNIT_EXPECT_EQ(test, dd_test_refcount(test, md, 0), U32_MAX);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).mapped, (u64)U32_MAX + 1);
	st = dd_test_stats(md);
	KUNIT_EXPECT_EQ(test, dd_test_map_dup(test, md, 3, 0), -EOVERFLOW);
	/* also for the logical block that already maps it */
	KUNIT_EXPECT_EQ(test, dd_test_map_dup(test, md, 2, 0), -EOVERFLOW);
	dd_test_expect_untouched(test, md, &st);
	KUNIT_EXPECT_EQ(test, dd_test_refcount(test, md, 0), U32_MAX);
	dd_test_expect_unmapped(test, md, 3);
	dd_test_expect_map(test, md, 2, 0);

	/* dropping references from the top works as from anywhere */
	KUNIT_EXPECT_EQ(test, dd_test_map_zero(test, md, 2), 0);
	KUNIT_EXPECT_EQ(test, dd_test_refcount(test, md, 0), U32_MAX - 1);
	KUNIT_EXPECT_EQ(test, dd_test_map_zero(test, md, 0), 0);
	KUNIT_EXPECT_EQ(test, dd_test_refcount(test, md, 0), U32_MAX - 2);
	KUNIT_EXPECT_EQ(test, ev->freed, 0);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).data_live, 2);
}

/*
 * A reference on a free block is a soft miss; a reference dropped below
 * zero is corruption and refused; nothing wraps.
 */
static void dd_md_test_refcount_errors(struct kunit *test)
{
	struct block_device *bdev = dd_test_dev_open(test);
	struct dd_md_config *cfg = dd_test_cfg(test, 100, 100);
	struct dd_metadata *md = dd_test_md_open(test, bdev, cfg);
	u8 fp[DD_FP_SIZE];
	u64 pba;

	pba = dd_test_write(test, md, 0, 1);
	KUNIT_ASSERT_EQ(test, pba, 0);
	dd_test_share(test, md, 2, pba);
	KUNIT_ASSERT_EQ(test, dd_test_commit(test, md), 0);
	dd_test_md_close(test, md);
	/*
	 * Two logical blocks on a block whose refcount says one, the
	 * superblock's sum made to agree so that activation accepts it.
	 */
	dd_test_patch_leaf(test, bdev, DD_SB_OFF_REFCOUNT_ROOT, 0, 1, 4);
	dd_test_patch_sb(test, bdev, DD_SB_OFF_MAPPED, 1, 8);
	md = dd_test_md_open(test, bdev, cfg);

	KUNIT_EXPECT_EQ(test, dd_test_map_dup(test, md, 1, 5), -ENOENT);
	KUNIT_EXPECT_EQ(test, dd_test_refcount(test, md, 5), 0);
	dd_test_expect_unmapped(test, md, 1);
	KUNIT_EXPECT_FALSE(test, dd_md_dirty(md));
	KUNIT_EXPECT_EQ(test, dd_test_map_dup(test, md, 1, 100), -ERANGE);
	/* a block allocated twice is caught, and keeps its refcount */
	dd_test_fp(fp, 2);
	KUNIT_EXPECT_EQ(test, dd_test_map_new(test, md, 1, pba, fp), -EILSEQ);
	KUNIT_EXPECT_EQ(test, dd_test_refcount(test, md, pba), 1);
	dd_test_expect_unmapped(test, md, 1);

	/* the first unmap frees the block, the second finds no reference */
	KUNIT_EXPECT_EQ(test, dd_test_map_zero(test, md, 0), 0);
	KUNIT_EXPECT_EQ(test, dd_test_ev(cfg)->freed, 1);
	KUNIT_EXPECT_EQ(test, dd_test_refcount(test, md, pba), 0);
	KUNIT_EXPECT_EQ(test, dd_test_map_zero(test, md, 2), -EILSEQ);
	KUNIT_EXPECT_EQ(test, dd_test_refcount(test, md, pba), 0);
	KUNIT_EXPECT_EQ(test, dd_test_ev(cfg)->freed, 1);
}

/*
 * Sharing a block that died since the caller found it is a soft miss:
 * -ENOENT, and nothing changes, not even the transaction's dirty state,
 * so that a commit after it has nothing to write.
 */
static void dd_md_test_duplicate_dead(struct kunit *test)
{
	struct block_device *bdev = dd_test_dev_open(test);
	struct dd_md_config *cfg = dd_test_cfg(test, 100, 100);
	struct dd_metadata *md = dd_test_md_open(test, bdev, cfg);
	struct dd_test_events *ev = dd_test_ev(cfg);
	struct dd_md_stats st;
	struct dd_md_freed f;
	u8 fp[DD_FP_SIZE];
	u64 dead, live;

	dead = dd_test_write(test, md, 0, 1);
	live = dd_test_write(test, md, 1, 2);
	KUNIT_ASSERT_EQ(test, dd_test_commit(test, md), 0);
	KUNIT_ASSERT_EQ(test, dd_test_map_zero(test, md, 0), 0);
	KUNIT_ASSERT_EQ(test, ev->freed, 1);
	KUNIT_ASSERT_EQ(test, dd_test_commit(test, md), 0);
	/* the second commit, which the first asks for, makes it free */
	KUNIT_ASSERT_TRUE(test, dd_md_dirty(md));
	KUNIT_ASSERT_EQ(test, dd_test_commit(test, md), 0);
	KUNIT_ASSERT_FALSE(test, dd_md_dirty(md));
	st = dd_test_stats(md);

	/*
	 * over a mapped logical block, an unmapped one, a block never used;
	 * the dead block's record still holds its fingerprint
	 */
	KUNIT_ASSERT_EQ(test, dd_md_get_fingerprint(md, dead, fp), 0);
	KUNIT_EXPECT_EQ(test, dd_md_map_duplicate(md, 1, dead, fp, &f), -ENOENT);
	KUNIT_EXPECT_EQ(test, dd_md_map_duplicate(md, 2, dead, fp, &f), -ENOENT);
	KUNIT_EXPECT_EQ(test, dd_md_map_duplicate(md, 2, 50, fp, &f), -ENOENT);
	/* a live block under another fingerprint: reused since it was seen */
	KUNIT_EXPECT_EQ(test, dd_md_holds(md, live, fp), 0);
	KUNIT_EXPECT_EQ(test, dd_md_map_duplicate(md, 2, live, fp, &f), -ENOENT);
	KUNIT_ASSERT_EQ(test, dd_md_get_fingerprint(md, live, fp), 0);
	KUNIT_EXPECT_EQ(test, dd_md_holds(md, live, fp), 1);

	dd_test_expect_untouched(test, md, &st);
	dd_test_expect_unmapped(test, md, 0);
	dd_test_expect_map(test, md, 1, live);
	dd_test_expect_unmapped(test, md, 2);
	KUNIT_EXPECT_EQ(test, dd_test_refcount(test, md, dead), 0);
	KUNIT_EXPECT_EQ(test, dd_test_refcount(test, md, live), 1);
	KUNIT_EXPECT_EQ(test, ev->freed, 1);
	KUNIT_EXPECT_EQ(test, dd_test_commit(test, md), 0);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).transaction_id,
			st.transaction_id);
}

/*
 * The first holders of a write's contents in one call: a content equal to
 * the one before it in the same leaf shares its answer, but not the same
 * content asked of another leaf right after it (here out of range: no
 * holder), a NULL one is not looked up, and a content nobody holds is
 * found nowhere.
 */
static void dd_md_test_first_holders(struct kunit *test)
{
	struct block_device *bdev = dd_test_dev_open(test);
	struct dd_md_config *cfg = dd_test_cfg(test, 100, 100);
	struct dd_metadata *md = dd_test_md_open(test, bdev, cfg);
	u8 fa[DD_FP_SIZE], fb[DD_FP_SIZE], fc[DD_FP_SIZE];
	const u8 *fp[7] = { fa, NULL, fa, fa, fb, fc, fa };
	u64 a, b, at[7];

	a = dd_test_write(test, md, 0, 1);
	b = dd_test_write(test, md, 1, 2);
	KUNIT_ASSERT_EQ(test, dd_md_get_fingerprint(md, a, fa), 0);
	KUNIT_ASSERT_EQ(test, dd_md_get_fingerprint(md, b, fb), 0);
	dd_test_fp(fc, 3);
	at[0] = a / DD_FP_PER_LEAF;
	at[1] = 7;
	at[2] = a / DD_FP_PER_LEAF;
	/* right after a's answer, the same content in another leaf */
	at[3] = a / DD_FP_PER_LEAF + 1;
	at[4] = b / DD_FP_PER_LEAF;
	at[5] = a / DD_FP_PER_LEAF;
	at[6] = a / DD_FP_PER_LEAF;
	dd_md_first_holders(md, at, fp, ARRAY_SIZE(at));
	KUNIT_EXPECT_EQ(test, at[0], a);
	KUNIT_EXPECT_EQ(test, at[1], DD_MD_NO_HOLDER);
	KUNIT_EXPECT_EQ(test, at[2], a);
	KUNIT_EXPECT_EQ(test, at[3], DD_MD_NO_HOLDER);
	KUNIT_EXPECT_EQ(test, at[4], b);
	KUNIT_EXPECT_EQ(test, at[5], DD_MD_NO_HOLDER);
	KUNIT_EXPECT_EQ(test, at[6], a);
}

/*
 * Allocation says why nothing is free: -EAGAIN when freed blocks come
 * back at the next commit or the one after (the target waits for them),
 * -ENOSPC when nothing will come back (the write fails).
 */
static void dd_md_test_alloc_data(struct kunit *test)
{
	struct block_device *bdev = dd_test_dev_open(test);
	struct dd_md_config *cfg = dd_test_cfg(test, 16, 4);
	struct dd_metadata *md = dd_test_md_open(test, bdev, cfg);
	u64 pba, left, i;
	u8 fp[DD_FP_SIZE];

	for (i = 0; i < 4; i++) {
		left = U64_MAX;
		KUNIT_ASSERT_EQ(test, dd_md_alloc_data(md, &pba, &left), 0);
		KUNIT_EXPECT_EQ(test, pba, i);
		KUNIT_EXPECT_EQ(test, left, 3 - i);
	}
	KUNIT_EXPECT_EQ(test, dd_md_alloc_data(md, &pba, &left), -ENOSPC);
	/* a failed write's block comes back at once, not at the commit */
	dd_md_free_data_now(md, 2);
	KUNIT_ASSERT_EQ(test, dd_md_alloc_data(md, &pba, &left), 0);
	KUNIT_EXPECT_EQ(test, pba, 2);
	KUNIT_EXPECT_EQ(test, left, 0);

	for (i = 0; i < 4; i++) {
		dd_test_fp(fp, i);
		KUNIT_ASSERT_EQ(test, dd_test_map_new(test, md, i, i, fp), 0);
	}
	KUNIT_EXPECT_EQ(test, dd_md_alloc_data(md, &pba, &left), -ENOSPC);
	KUNIT_ASSERT_EQ(test, dd_test_commit(test, md), 0);
	KUNIT_EXPECT_EQ(test, dd_md_alloc_data(md, &pba, &left), -ENOSPC);

	KUNIT_ASSERT_EQ(test, dd_test_map_zero(test, md, 1), 0);
	KUNIT_EXPECT_EQ(test, dd_md_pending_data_frees(md), 1);
	KUNIT_EXPECT_EQ(test, dd_md_free_data_blocks(md), 0);
	KUNIT_EXPECT_EQ(test, dd_md_alloc_data(md, &pba, &left), -EAGAIN);
	KUNIT_EXPECT_EQ(test, dd_md_alloc_data(md, &pba, &left), -EAGAIN);
	KUNIT_ASSERT_EQ(test, dd_test_commit(test, md), 0);
	KUNIT_EXPECT_EQ(test, dd_md_alloc_data(md, &pba, &left), -EAGAIN);
	KUNIT_ASSERT_EQ(test, dd_test_commit(test, md), 0);
	left = U64_MAX;
	KUNIT_ASSERT_EQ(test, dd_md_alloc_data(md, &pba, &left), 0);
	KUNIT_EXPECT_EQ(test, pba, 1);
	KUNIT_EXPECT_EQ(test, left, 0);
	KUNIT_EXPECT_EQ(test, dd_md_alloc_data(md, &pba, &left), -ENOSPC);
}

/*
 * Blocks promised to writes acknowledged before their decision: no other
 * writer takes them, and one that finds only promised blocks free waits
 * for them (-EAGAIN) instead of failing; a promised block is taken even
 * when the count shows none free; the device reports them as free; a
 * promise given back is free for anyone; full is full once none is out.
 */
static void dd_md_test_promise(struct kunit *test)
{
	struct block_device *bdev = dd_test_dev_open(test);
	struct dd_md_config *cfg = dd_test_cfg(test, 16, 4);
	struct dd_metadata *md = dd_test_md_open(test, bdev, cfg);
	u64 first = U64_MAX, len = 0, left = U64_MAX, pba = U64_MAX;

	KUNIT_EXPECT_TRUE(test, dd_md_promise_data(md, 3));
	KUNIT_EXPECT_FALSE(test, dd_md_promise_data(md, 2));
	KUNIT_EXPECT_EQ(test, dd_md_free_data_blocks(md), 4);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).data_used, 0);
	KUNIT_ASSERT_EQ(test, dd_md_alloc_data(md, &pba, &left), 0);
	/* free as the device reports it: the promised blocks */
	KUNIT_EXPECT_EQ(test, left, 3);
	KUNIT_EXPECT_EQ(test, dd_md_alloc_data(md, &pba, &left), -EAGAIN);
	KUNIT_ASSERT_EQ(test, dd_md_alloc_data_run(md, 2, true, &first, &len,
						   &left), 0);
	KUNIT_EXPECT_EQ(test, len, 2);
	KUNIT_EXPECT_NE(test, first, pba);
	KUNIT_EXPECT_NE(test, first + 1, pba);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).data_used, 3);
	dd_md_promise_drop(md, 1);
	KUNIT_EXPECT_EQ(test, dd_md_free_data_blocks(md), 1);
	KUNIT_ASSERT_EQ(test, dd_md_alloc_data(md, &pba, &left), 0);
	KUNIT_EXPECT_EQ(test, dd_md_alloc_data(md, &pba, &left), -ENOSPC);
	KUNIT_EXPECT_FALSE(test, dd_md_promise_data(md, 1));
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).data_used, 4);
}

/*
 * Runs: the allocator hands out consecutive blocks up to a used one; a
 * lookup run follows consecutive physical blocks, or unmapped blocks,
 * and stops at the first block that reads from elsewhere.
 */
static void dd_md_test_runs(struct kunit *test)
{
	struct block_device *bdev = dd_test_dev_open(test);
	struct dd_md_config *cfg = dd_test_cfg(test, 64, 16);
	struct dd_metadata *md = dd_test_md_open(test, bdev, cfg);
	u64 first = U64_MAX, len = 0, left = 0, pba = 0, nr = 0, i;
	u8 fp[DD_FP_SIZE];

	KUNIT_ASSERT_EQ(test, dd_md_alloc_data_run(md, 6, false, &first, &len,
						   &left), 0);
	KUNIT_EXPECT_EQ(test, first, 0);
	KUNIT_EXPECT_EQ(test, len, 6);
	KUNIT_EXPECT_EQ(test, left, 10);
	/* lbas 10-15 on pbas 0-5, in order, except that 13 is pba 5, 15 is 3 */
	for (i = 0; i < 6; i++) {
		dd_test_fp(fp, 100 + i);
		pba = i == 3 ? 5 : i == 5 ? 3 : i;
		KUNIT_ASSERT_EQ(test, dd_test_map_new(test, md, 10 + i, pba, fp),
				0);
	}
	KUNIT_EXPECT_EQ(test, dd_md_lookup_run(md, 10, 64, &pba, &nr, false), 0);
	KUNIT_EXPECT_EQ(test, pba, 0);
	KUNIT_EXPECT_EQ(test, nr, 3);
	KUNIT_EXPECT_EQ(test, dd_md_lookup_run(md, 11, 1, &pba, &nr, false), 0);
	KUNIT_EXPECT_EQ(test, pba, 1);
	KUNIT_EXPECT_EQ(test, nr, 1);
	KUNIT_EXPECT_EQ(test, dd_md_lookup_run(md, 13, 64, &pba, &nr, false), 0);
	KUNIT_EXPECT_EQ(test, pba, 5);
	KUNIT_EXPECT_EQ(test, nr, 1);
	KUNIT_EXPECT_EQ(test, dd_md_lookup_run(md, 15, 64, &pba, &nr, false), 0);
	KUNIT_EXPECT_EQ(test, pba, 3);
	KUNIT_EXPECT_EQ(test, nr, 1);
	/* 0-9 unmapped: one run up to the first mapped block */
	KUNIT_EXPECT_EQ(test, dd_md_lookup_run(md, 2, 64, &pba, &nr, false),
			-ENODATA);
	KUNIT_EXPECT_EQ(test, nr, 8);
	KUNIT_EXPECT_EQ(test, dd_md_lookup_run(md, 16, 48, &pba, &nr, false),
			-ENODATA);
	KUNIT_EXPECT_EQ(test, nr, 48);

	/* The next run starts after the last: 6-15, then nothing left. */
	KUNIT_ASSERT_EQ(test, dd_md_alloc_data_run(md, 64, false, &first, &len,
						   &left), 0);
	KUNIT_EXPECT_EQ(test, first, 6);
	KUNIT_EXPECT_EQ(test, len, 10);
	KUNIT_EXPECT_EQ(test, left, 0);
	KUNIT_EXPECT_EQ(test,
			dd_md_alloc_data_run(md, 1, false, &first, &len, &left),
			-ENOSPC);
}

/*
 * A few blocks come from this CPU's reservation, which the allocator
 * fills a run at a time: the reserved blocks count as free, a large run
 * is taken around them, and the device is full only once they are gone.
 */
static void dd_md_test_reserve(struct kunit *test)
{
	struct block_device *bdev = dd_test_dev_open(test);
	struct dd_md_config *cfg = dd_test_cfg(test, 256, 2 * DD_RESERVE_RUN);
	struct dd_metadata *md = dd_test_md_open(test, bdev, cfg);
	u64 first = U64_MAX, len = 0, left = 0, pba = 0;

	KUNIT_EXPECT_EQ(test, dd_test_alloc(test, md), 0);
	KUNIT_EXPECT_EQ(test, dd_md_free_data_blocks(md), 2 * DD_RESERVE_RUN - 1);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).data_used, 1);
	KUNIT_EXPECT_EQ(test, dd_test_alloc(test, md), 1);
	/* A large run is not taken from the reservation but beside it. */
	KUNIT_ASSERT_EQ(test, dd_md_alloc_data_run(md, DD_RESERVE_RUN, false,
						   &first, &len, &left), 0);
	KUNIT_EXPECT_EQ(test, first, DD_RESERVE_RUN);
	KUNIT_EXPECT_EQ(test, len, DD_RESERVE_RUN);
	KUNIT_EXPECT_EQ(test, left, DD_RESERVE_RUN - 2);
	/* Nothing else is free: the next one drains the reservation. */
	KUNIT_ASSERT_EQ(test, dd_md_alloc_data_run(md, DD_RESERVE_RUN, false,
						   &first, &len, &left), 0);
	KUNIT_EXPECT_EQ(test, first, 2);
	KUNIT_EXPECT_EQ(test, len, DD_RESERVE_RUN - 2);
	KUNIT_EXPECT_EQ(test, left, 0);
	KUNIT_EXPECT_EQ(test, dd_md_alloc_data(md, &pba, &left), -ENOSPC);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).data_used, 2 * DD_RESERVE_RUN);
	/* A block given back is handed out again, and counted once. */
	dd_md_free_data_now(md, 5);
	KUNIT_EXPECT_EQ(test, dd_md_free_data_blocks(md), 1);
	KUNIT_EXPECT_EQ(test, dd_test_alloc(test, md), 5);
	KUNIT_EXPECT_EQ(test, dd_md_free_data_blocks(md), 0);
}

/*
 * A run of new blocks mapped in one call stops after the first that frees
 * a block, reporting it; the caller goes on from there.
 */
static void dd_md_test_map_new_run(struct kunit *test)
{
	struct block_device *bdev = dd_test_dev_open(test);
	struct dd_md_config *cfg = dd_test_cfg(test, 64, 16);
	struct dd_metadata *md = dd_test_md_open(test, bdev, cfg);
	u8 fp[4][DD_FP_SIZE];
	struct dd_md_new nb[3];
	struct dd_md_freed f;
	unsigned int done = 0, i;
	u64 old = dd_test_write(test, md, 21, 77);

	for (i = 0; i < 3; i++) {
		dd_test_fp(fp[i], 200 + i);
		nb[i].lba = 20 + i;
		nb[i].pba = dd_test_alloc(test, md);
		nb[i].fp = fp[i];
	}
	/* lba 21 held the only reference to @old: the run stops there. */
	KUNIT_EXPECT_EQ(test, dd_md_map_new_run(md, nb, 3, &done, &f), 1);
	KUNIT_EXPECT_EQ(test, done, 2);
	KUNIT_EXPECT_EQ(test, f.pba, old);
	dd_test_expect_map(test, md, 20, nb[0].pba);
	dd_test_expect_map(test, md, 21, nb[1].pba);
	dd_test_expect_unmapped(test, md, 22);
	KUNIT_EXPECT_EQ(test, dd_md_map_new_run(md, nb + 2, 1, &done, &f), 0);
	KUNIT_EXPECT_EQ(test, done, 1);
	dd_test_expect_map(test, md, 22, nb[2].pba);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).unique_writes, 4);
}

static void dd_md_test_unmap_range(struct kunit *test)
{
	static const u64 lbas[] = { 0, 507, 508, 1000, 1999 };
	struct block_device *bdev = dd_test_dev_open(test);
	struct dd_md_config *cfg = dd_test_cfg(test, 2000, 16);
	struct dd_metadata *md = dd_test_md_open(test, bdev, cfg);
	u64 pba[ARRAY_SIZE(lbas)], n;
	unsigned int i;

	for (i = 0; i < ARRAY_SIZE(lbas); i++)
		pba[i] = dd_test_write(test, md, lbas[i], i);
	dd_test_share(test, md, 509, pba[0]);
	KUNIT_ASSERT_EQ(test, dd_test_commit(test, md), 0);

	KUNIT_EXPECT_EQ(test, dd_test_unmap(test, md, 5, 4, &n), -ERANGE);
	KUNIT_EXPECT_EQ(test, dd_test_unmap(test, md, 0, 2001, &n), -ERANGE);
	KUNIT_EXPECT_EQ(test, dd_test_unmap(test, md, 7, 7, &n), 0);
	KUNIT_EXPECT_EQ(test, n, 0);
	/* never mapped, in a leaf that does not exist */
	KUNIT_EXPECT_EQ(test, dd_test_unmap(test, md, 1100, 1500, &n), 0);
	KUNIT_EXPECT_EQ(test, n, 0);

	KUNIT_ASSERT_EQ(test, dd_test_unmap(test, md, 1, 1001, &n), 0);
	KUNIT_EXPECT_EQ(test, n, 4);
	dd_test_expect_map(test, md, 0, pba[0]);
	dd_test_expect_unmapped(test, md, 507);
	dd_test_expect_unmapped(test, md, 508);
	dd_test_expect_unmapped(test, md, 509);
	dd_test_expect_unmapped(test, md, 1000);
	dd_test_expect_map(test, md, 1999, pba[4]);
	KUNIT_EXPECT_EQ(test, dd_test_refcount(test, md, pba[0]), 1);
	KUNIT_EXPECT_EQ(test, dd_test_refcount(test, md, pba[1]), 0);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).discarded, 4);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).mapped, 2);
	KUNIT_EXPECT_EQ(test, dd_md_pending_data_frees(md), 3);

	KUNIT_ASSERT_EQ(test, dd_test_unmap(test, md, 0, 2000, &n), 0);
	KUNIT_EXPECT_EQ(test, n, 2);
	KUNIT_ASSERT_EQ(test, dd_test_commit(test, md), 0);
	dd_test_md_close(test, md);
	md = dd_test_md_open(test, bdev, cfg);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).mapped, 0);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).data_used, 0);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).discarded, 6);
}

/*
 * A caller with room for one freed block at a time: each call stops at
 * the block that filled it, also in the middle of a leaf (508 map entries
 * each), and the next call resumes right after it. Shared blocks are
 * freed with their last logical block, every block exactly once.
 */
static void dd_md_test_unmap_max_freed(struct kunit *test)
{
	static const u64 lbas[] = { 0, 3, 507, 508, 1000, 1999 };
	/* after each call: where to resume, and which write's block it freed */
	static const u64 want_next[] = { 4, 508, 509, 510, 1002, 1500 };
	static const unsigned int want_freed[] = { 1, 2, 3, 0, 4 };
	struct block_device *bdev = dd_test_dev_open(test);
	struct dd_md_config *cfg = dd_test_cfg(test, 2000, 16);
	struct dd_metadata *md = dd_test_md_open(test, bdev, cfg);
	struct dd_md_freed f[2], canary;
	u64 pba[ARRAY_SIZE(lbas)], next = 0, unmapped = 100;
	unsigned int i, nr;
	u8 fp[DD_FP_SIZE];

	for (i = 0; i < ARRAY_SIZE(lbas); i++)
		pba[i] = dd_test_write(test, md, lbas[i], i);
	dd_test_share(test, md, 509, pba[0]);
	dd_test_share(test, md, 1001, pba[4]);
	KUNIT_ASSERT_EQ(test, dd_test_commit(test, md), 0);
	memset(&canary, 0xa5, sizeof(canary));

	for (i = 0; i < ARRAY_SIZE(want_next); i++) {
		KUNIT_ASSERT_LT(test, next, 1500);
		f[1] = canary;
		KUNIT_ASSERT_EQ(test, dd_md_unmap_range(md, next, 1500, f, 1, &nr,
							&next, &unmapped), 0);
		KUNIT_EXPECT_EQ_MSG(test, next, want_next[i], "call %u", i);
		KUNIT_EXPECT_MEMEQ(test, &f[1], &canary, sizeof(canary));
		if (i == ARRAY_SIZE(want_freed)) {
			KUNIT_EXPECT_EQ(test, nr, 0);
			break;
		}
		KUNIT_ASSERT_EQ_MSG(test, nr, 1, "call %u", i);
		KUNIT_EXPECT_EQ(test, f[0].pba, pba[want_freed[i]]);
		dd_test_fp(fp, want_freed[i]);
		KUNIT_EXPECT_MEMEQ(test, f[0].fp, fp, DD_FP_SIZE);
	}
	KUNIT_EXPECT_EQ(test, next, 1500);
	/* 0, 3, 507, 508, 509, 1000 and 1001, added to what was there */
	KUNIT_EXPECT_EQ(test, unmapped, 107);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).discarded, 7);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).mapped, 1);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).data_live, 1);
	KUNIT_EXPECT_EQ(test, dd_md_pending_data_frees(md), 5);
	for (i = 0; i < ARRAY_SIZE(lbas) - 1; i++)
		KUNIT_EXPECT_EQ(test, dd_test_refcount(test, md, pba[i]), 0);
	dd_test_expect_map(test, md, 1999, pba[5]);

	/* called once more at the end, nothing is left to do */
	KUNIT_ASSERT_EQ(test, dd_md_unmap_range(md, next, 1500, f, 1, &nr,
						&next, &unmapped), 0);
	KUNIT_EXPECT_EQ(test, nr, 0);
	KUNIT_EXPECT_EQ(test, next, 1500);
	KUNIT_EXPECT_EQ(test, unmapped, 107);
}

/* A map of height 2: the first and the last LBA, through a reopen. */
static void dd_md_test_tall_map(struct kunit *test)
{
	const u64 logical = 508 * 508 + 1;
	struct block_device *bdev = dd_test_dev_open(test);
	struct dd_md_config *cfg = dd_test_cfg(test, logical, 4);
	struct dd_metadata *md = dd_test_md_open(test, bdev, cfg);
	u64 pba, n;

	pba = dd_test_write(test, md, 0, 1);
	dd_test_share(test, md, logical - 1, pba);
	KUNIT_ASSERT_EQ(test, dd_test_commit(test, md), 0);
	dd_test_md_close(test, md);

	md = dd_test_md_open(test, bdev, cfg);
	dd_test_expect_map(test, md, 0, pba);
	dd_test_expect_map(test, md, logical - 1, pba);
	dd_test_expect_unmapped(test, md, logical - 2);
	dd_test_expect_unmapped(test, md, 508 * 508 / 2);
	KUNIT_ASSERT_EQ(test, dd_test_unmap(test, md, 1, logical, &n), 0);
	KUNIT_EXPECT_EQ(test, n, 1);
	KUNIT_EXPECT_EQ(test, dd_test_refcount(test, md, pba), 1);
}

/*
 * A larger table grows the committed device in place: the map from two
 * leaves to a tree two levels tall, refcounts and fingerprints from one
 * leaf to several. What was stored stays, the new blocks are allocated
 * and mapped, and the grown sizes are what the next open finds.
 */
static void dd_md_test_grow(struct kunit *test)
{
	const u64 logical = 508 * 508 + 1, data = 2000;
	struct block_device *bdev = dd_test_dev_open(test);
	struct dd_md_config *cfg = dd_test_cfg(test, 1000, 8);
	struct dd_metadata *md = dd_test_md_open(test, bdev, cfg);
	struct dd_md_stats st;
	const char *error;
	u64 pba, last, i;

	pba = dd_test_write(test, md, 999, 1);
	dd_test_share(test, md, 0, pba);
	for (i = 1; i < 8; i++)
		dd_test_write(test, md, i, 10 + i);
	KUNIT_ASSERT_EQ(test, dd_test_commit(test, md), 0);
	dd_test_md_close(test, md);

	cfg->logical_blocks = logical;
	cfg->data_blocks = data;
	md = dd_test_md_open(test, bdev, cfg);
	st = dd_test_stats(md);
	KUNIT_EXPECT_EQ(test, st.data_total, data);
	KUNIT_EXPECT_EQ(test, st.data_live, 8);
	KUNIT_EXPECT_EQ(test, st.mapped, 9);
	KUNIT_EXPECT_FALSE(test, dd_md_dirty(md));
	dd_test_expect_map(test, md, 999, pba);
	dd_test_expect_map(test, md, 0, pba);
	dd_test_expect_fp(test, md, 7, 17);
	dd_test_expect_unmapped(test, md, logical - 1);
	KUNIT_EXPECT_EQ(test, dd_test_refcount(test, md, pba), 2);
	KUNIT_EXPECT_EQ(test, dd_test_refcount(test, md, data - 1), 0);

	/* every new data block is free, up to the last one */
	for (i = 8; i < data; i++)
		last = dd_test_alloc(test, md);
	KUNIT_EXPECT_EQ(test, last, data - 1);
	KUNIT_EXPECT_EQ(test, dd_md_free_data_blocks(md), 0);
	dd_md_free_data_now(md, last);
	last = dd_test_write(test, md, logical - 1, 5);
	KUNIT_EXPECT_EQ(test, last, data - 1);
	KUNIT_ASSERT_EQ(test, dd_test_commit(test, md), 0);
	dd_test_md_close(test, md);

	md = dd_test_md_open(test, bdev, cfg);
	dd_test_expect_map(test, md, logical - 1, data - 1);
	dd_test_expect_fp(test, md, data - 1, 5);
	dd_test_expect_map(test, md, 999, pba);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).data_live, 9);
	dd_test_md_close(test, md);

	/* the old sizes are a shrink now */
	cfg->logical_blocks = 1000;
	KUNIT_EXPECT_EQ(test, dd_test_try_open(bdev, cfg, &error), -EINVAL);
	KUNIT_EXPECT_NOT_NULL(test, strstr(error, "logical_blocks"));
	cfg->logical_blocks = logical;
	cfg->data_blocks = 8;
	KUNIT_EXPECT_EQ(test, dd_test_try_open(bdev, cfg, &error), -EINVAL);
	KUNIT_EXPECT_NOT_NULL(test, strstr(error, "data_blocks"));
}

/*
 * Damage found at run time is recorded in the superblock: the running
 * transaction is dropped, and every later open is read-only until the
 * flag is cleared (as `dedup check --clear-needs-check` does). Flags this
 * version does not know are refused.
 */
static void dd_md_test_needs_check(struct kunit *test)
{
	struct block_device *bdev = dd_test_dev_open(test);
	struct dd_md_config *cfg = dd_test_cfg(test, 1000, 100);
	struct dd_metadata *md = dd_test_md_open(test, bdev, cfg);
	u8 *raw = kunit_kmalloc(test, DD_BLOCK_SIZE, GFP_KERNEL);
	const char *error;
	u64 pba, got, left;

	KUNIT_ASSERT_NOT_NULL(test, raw);
	pba = dd_test_write(test, md, 3, 3);
	KUNIT_ASSERT_EQ(test, dd_test_commit(test, md), 0);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).transaction_id, 2);
	dd_test_write(test, md, 4, 4);
	KUNIT_EXPECT_FALSE(test, dd_md_needs_check(md));

	KUNIT_ASSERT_EQ(test, dd_md_flag_needs_check(md), 1);
	KUNIT_EXPECT_TRUE(test, dd_md_needs_check(md));
	dd_test_expect_map(test, md, 3, pba);
	dd_test_expect_unmapped(test, md, 4);
	KUNIT_EXPECT_EQ(test, dd_test_commit(test, md), -EROFS);
	/* the next generation, in the other slot: the same state, flagged */
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).transaction_id, 3);
	KUNIT_EXPECT_EQ(test, dd_test_sb_slot(test, bdev, raw), 1);
	KUNIT_EXPECT_EQ(test, get_unaligned_le32(raw + DD_SB_OFF_FLAGS),
			DD_SB_NEEDS_CHECK | DD_SB_UNFLUSHED_APPENDS);
	/* already on disk: 1 again, and nothing written */
	KUNIT_ASSERT_EQ(test, dd_md_flag_needs_check(md), 1);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).transaction_id, 3);
	dd_test_md_close(test, md);

	/* a read-write table opens it read-only, and writes nothing */
	md = dd_test_md_open(test, bdev, cfg);
	KUNIT_EXPECT_TRUE(test, dd_md_needs_check(md));
	dd_test_expect_map(test, md, 3, pba);
	KUNIT_EXPECT_EQ(test, dd_md_alloc_data(md, &got, &left), -EROFS);
	KUNIT_EXPECT_EQ(test, dd_test_commit(test, md), -EROFS);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).transaction_id, 3);
	dd_test_md_close(test, md);
	cfg->data_blocks = 200;
	KUNIT_EXPECT_EQ(test, dd_test_try_open(bdev, cfg, &error), -EINVAL);
	KUNIT_EXPECT_NOT_NULL(test, strstr(error, "needs_check"));
	cfg->data_blocks = 100;

	dd_test_patch_sb(test, bdev, DD_SB_OFF_FLAGS, DD_SB_NEEDS_CHECK | 0x4, 4);
	KUNIT_EXPECT_EQ(test, dd_test_try_open(bdev, cfg, &error), -EINVAL);
	KUNIT_EXPECT_STREQ(test, error, "metadata superblock has unknown flags");

	dd_test_patch_sb(test, bdev, DD_SB_OFF_FLAGS, 0, 4);
	md = dd_test_md_open(test, bdev, cfg);
	KUNIT_EXPECT_FALSE(test, dd_md_needs_check(md));
	dd_test_write(test, md, 4, 4);
	KUNIT_EXPECT_EQ(test, dd_test_commit(test, md), 0);

	/* a read_only table never writes, not even the flag */
	dd_test_md_close(test, md);
	cfg->read_only = true;
	md = dd_test_md_open(test, bdev, cfg);
	KUNIT_EXPECT_EQ(test, dd_md_flag_needs_check(md), 0);
	KUNIT_EXPECT_FALSE(test, dd_md_needs_check(md));
	dd_test_sb_slot(test, bdev, raw);
	KUNIT_EXPECT_EQ(test, get_unaligned_le32(raw + DD_SB_OFF_FLAGS),
			DD_SB_UNFLUSHED_APPENDS);
}

/*
 * Short digests (crc32c) keep fp_size bytes and zero the rest, and an
 * all-zero digest is legitimate for them, not a missing record.
 */
static void dd_md_test_short_fingerprint(struct kunit *test)
{
	struct block_device *bdev = dd_test_dev_open(test);
	struct dd_md_config *cfg = dd_test_cfg(test, 100, 100);
	u8 fp[DD_FP_SIZE], got[DD_FP_SIZE], zero[DD_FP_SIZE] = {};
	struct dd_metadata *md;
	u64 pba;

	cfg->hash_name = "crc32c";
	cfg->fp_size = 4;
	md = dd_test_md_open(test, bdev, cfg);
	pba = dd_test_write(test, md, 0, 77);
	dd_test_fp(fp, 77);
	KUNIT_ASSERT_EQ(test, dd_md_get_fingerprint(md, pba, got), 0);
	KUNIT_EXPECT_MEMEQ(test, got, fp, 4);
	KUNIT_EXPECT_NULL(test, memchr_inv(got + 4, 0, DD_FP_SIZE - 4));
	pba = dd_test_alloc(test, md);
	KUNIT_ASSERT_EQ(test, dd_test_map_new(test, md, 1, pba, zero), 0);
	KUNIT_ASSERT_EQ(test, dd_test_commit(test, md), 0);
	dd_test_md_close(test, md);

	md = dd_test_md_open(test, bdev, cfg);
	KUNIT_EXPECT_EQ(test, dd_test_ev(cfg)->visited, 2);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).data_live, 2);
}

/*
 * With a long digest an all-zero record means it was never written: the
 * format document makes activation refuse it (invariant 15).
 */
static void dd_md_test_zero_fingerprint(struct kunit *test)
{
	struct block_device *bdev = dd_test_dev_open(test);
	struct dd_md_config *cfg = dd_test_cfg(test, 100, 100);
	struct dd_metadata *md = dd_test_md_open(test, bdev, cfg);
	u8 zero[DD_FP_SIZE] = {};
	const char *error;

	KUNIT_ASSERT_EQ(test, dd_test_map_new(test, md, 0,
					      dd_test_alloc(test, md), zero), 0);
	KUNIT_ASSERT_EQ(test, dd_test_commit(test, md), 0);
	dd_test_md_close(test, md);
	KUNIT_EXPECT_EQ(test, dd_test_try_open(bdev, cfg, &error), -EILSEQ);
	KUNIT_EXPECT_NOT_NULL(test, strstr(error, "inconsistent"));
}

/*
 * Generations alternate between the slots; a damaged newest superblock
 * leaves the previous commit, whose blocks nothing has overwritten yet.
 * The load writes that state to the damaged slot as the next generation.
 */
static void dd_md_test_superblock_fallback(struct kunit *test)
{
	struct block_device *bdev = dd_test_dev_open(test);
	struct dd_md_config *cfg = dd_test_cfg(test, 100, 100);
	struct dd_metadata *md = dd_test_md_open(test, bdev, cfg);
	u8 *raw = kunit_kmalloc(test, DD_BLOCK_SIZE, GFP_KERNEL);
	const char *error;

	KUNIT_ASSERT_NOT_NULL(test, raw);
	dd_test_write(test, md, 0, 1);
	KUNIT_ASSERT_EQ(test, dd_test_commit(test, md), 0);
	dd_test_write(test, md, 1, 2);
	KUNIT_ASSERT_EQ(test, dd_test_commit(test, md), 0);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).transaction_id, 3);
	dd_test_md_close(test, md);
	KUNIT_EXPECT_EQ(test, dd_test_sb_slot(test, bdev, raw), 1);
	KUNIT_EXPECT_EQ(test, get_unaligned_le64(raw + 16), 3);

	dd_test_flip_bit(test, bdev, 1, 150, 3);
	md = dd_test_md_open(test, bdev, cfg);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).transaction_id, 3);
	dd_test_expect_map(test, md, 0, 0);
	dd_test_expect_unmapped(test, md, 1);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).mapped, 1);
	dd_test_md_close(test, md);
	KUNIT_EXPECT_EQ(test, dd_test_sb_slot(test, bdev, raw), 1);
	KUNIT_EXPECT_EQ(test, get_unaligned_le64(raw + 16), 3);
	KUNIT_EXPECT_TRUE(test, dd_block_csum_ok(raw));

	dd_test_flip_bit(test, bdev, 0, 4000, 0);
	dd_test_flip_bit(test, bdev, 1, 4000, 0);
	KUNIT_EXPECT_EQ(test, dd_test_try_open(bdev, cfg, &error), -EINVAL);
	KUNIT_EXPECT_NOT_NULL(test, strstr(error, "no valid superblock"));
}

/* The newest superblock, rewritten with transaction id @txn. */
static void dd_test_set_txn(struct kunit *test, struct block_device *bdev,
			    u8 *raw, u64 txn)
{
	u64 slot = dd_test_sb_slot(test, bdev, raw);

	put_unaligned_le64(txn, raw + 16);
	put_unaligned_le32(dd_block_csum(raw), raw);
	dd_test_write_block(test, bdev, slot, raw);
}

/*
 * A superblock whose transaction id is near 2^64 is refused: committing
 * on would wrap the id, and the older slot would then win at the next
 * open, rolling the device back onto blocks reused since.
 */
static void dd_md_test_txn_limit(struct kunit *test)
{
	struct block_device *bdev = dd_test_dev_open(test);
	struct dd_md_config *cfg = dd_test_cfg(test, 100, 100);
	struct dd_metadata *md = dd_test_md_open(test, bdev, cfg);
	u8 *raw = kunit_kmalloc(test, DD_BLOCK_SIZE, GFP_KERNEL);
	const char *error;

	KUNIT_ASSERT_NOT_NULL(test, raw);
	dd_test_write(test, md, 0, 1);
	KUNIT_ASSERT_EQ(test, dd_test_commit(test, md), 0);
	dd_test_md_close(test, md);

	dd_test_set_txn(test, bdev, raw, DD_MAX_TXN);
	md = dd_test_md_open(test, bdev, cfg);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).transaction_id, DD_MAX_TXN);
	dd_test_expect_map(test, md, 0, 0);
	dd_test_md_close(test, md);
	/* growing needs a commit, and none is left */
	cfg->data_blocks = 200;
	KUNIT_EXPECT_EQ(test, dd_test_try_open(bdev, cfg, &error), -EINVAL);
	KUNIT_EXPECT_NOT_NULL(test, strstr(error, "transaction id limit"));
	cfg->data_blocks = 100;

	dd_test_set_txn(test, bdev, raw, DD_MAX_TXN + 1);
	KUNIT_EXPECT_EQ(test, dd_test_try_open(bdev, cfg, &error), -EINVAL);
	KUNIT_EXPECT_NOT_NULL(test, strstr(error, "transaction id"));
}

/*
 * Damage in a committed tree block: activation reads the refcount and
 * fingerprint trees and refuses them; map leaves are read on lookup.
 */
static void dd_md_test_damaged_tree(struct kunit *test)
{
	struct block_device *bdev = dd_test_dev_open(test);
	struct dd_md_config *cfg = dd_test_cfg(test, 100, 100);
	struct dd_metadata *md = dd_test_md_open(test, bdev, cfg);
	u8 *sb = kunit_kmalloc(test, DD_BLOCK_SIZE, GFP_KERNEL);
	u64 map_leaf, rc_leaf, got;
	const char *error;

	KUNIT_ASSERT_NOT_NULL(test, sb);
	dd_test_write(test, md, 0, 1);
	KUNIT_ASSERT_EQ(test, dd_test_commit(test, md), 0);
	dd_test_md_close(test, md);
	dd_test_sb_slot(test, bdev, sb);
	map_leaf = get_unaligned_le64(sb + DD_SB_OFF_MAP_ROOT);
	rc_leaf = get_unaligned_le64(sb + DD_SB_OFF_REFCOUNT_ROOT);

	dd_test_flip_bit(test, bdev, map_leaf, 2500, 7);
	md = dd_test_md_open(test, bdev, cfg);
	KUNIT_EXPECT_EQ(test, dd_md_lookup(md, 0, &got, false), -EILSEQ);
	dd_test_md_close(test, md);

	dd_test_flip_bit(test, bdev, rc_leaf, 40, 1);
	KUNIT_EXPECT_EQ(test, dd_test_try_open(bdev, cfg, &error), -EILSEQ);
	KUNIT_EXPECT_NOT_NULL(test, strstr(error, "damaged"));
}

/* A map entry that points past the data device is corruption. */
static void dd_md_test_map_beyond_data(struct kunit *test)
{
	struct block_device *bdev = dd_test_dev_open(test);
	struct dd_md_config *cfg = dd_test_cfg(test, 100, 100);
	struct dd_metadata *md = dd_test_md_open(test, bdev, cfg);
	u8 fp[DD_FP_SIZE];
	u64 got;

	dd_test_write(test, md, 0, 1);
	dd_test_write(test, md, 99, 2);
	KUNIT_ASSERT_EQ(test, dd_test_commit(test, md), 0);
	dd_test_md_close(test, md);

	/* entry v means PBA v - 1: 100 is the last PBA, 101 is past it */
	dd_test_patch_leaf(test, bdev, DD_SB_OFF_MAP_ROOT, 0, 100, 8);
	dd_test_patch_leaf(test, bdev, DD_SB_OFF_MAP_ROOT, 99 * 8, 101, 8);
	md = dd_test_md_open(test, bdev, cfg);
	dd_test_expect_map(test, md, 0, 99);
	KUNIT_EXPECT_EQ(test, dd_md_lookup(md, 99, &got, false), -EILSEQ);
	dd_test_md_close(test, md);

	/* Far past it: beyond the refcount array too. */
	dd_test_patch_leaf(test, bdev, DD_SB_OFF_MAP_ROOT, 99 * 8, 1ULL << 40,
			   8);
	md = dd_test_md_open(test, bdev, cfg);
	KUNIT_EXPECT_EQ(test, dd_md_lookup(md, 99, &got, false), -EILSEQ);

	/*
	 * A new block written over that entry finds the same damage (the
	 * device is then checked), not a refcount index out of range (which
	 * only made it read-only): first by copying the leaf, then in place
	 * in the copy. The entry stays as it was; the rest of the failed
	 * change goes with the transaction, which the target aborts.
	 */
	dd_test_fp(fp, 3);
	KUNIT_EXPECT_EQ(test, dd_test_map_new(test, md, 99, 50, fp), -EILSEQ);
	KUNIT_EXPECT_EQ(test, dd_test_map_new(test, md, 99, 51, fp), -EILSEQ);
	KUNIT_EXPECT_EQ(test, dd_md_lookup(md, 99, &got, false), -EILSEQ);
}

/*
 * Many small commits: the metadata allocator wraps around the device
 * twice (five blocks shadowed per commit, 4094 blocks), so freed blocks
 * are reused; the trees must stay intact throughout.
 */
static void dd_md_test_commit_churn(struct kunit *test)
{
	const unsigned int nr_lba = 256, commits = 2000;
	struct block_device *bdev = dd_test_dev_open(test);
	struct dd_md_config *cfg = dd_test_cfg(test, 4096, 512);
	struct dd_metadata *md = dd_test_md_open(test, bdev, cfg);
	u64 *pba = kunit_kcalloc(test, nr_lba, sizeof(u64), GFP_KERNEL);
	u64 *seed = kunit_kcalloc(test, nr_lba, sizeof(u64), GFP_KERNEL);
	u64 used = 0, lba, txn;
	unsigned int i, pass;

	KUNIT_ASSERT_NOT_NULL(test, pba);
	KUNIT_ASSERT_NOT_NULL(test, seed);
	for (i = 0; i < commits; i++) {
		/* spread over the map's leaves and the data device */
		lba = (i * 97) % nr_lba * 16;
		seed[lba / 16] = 1000 + i;
		pba[lba / 16] = dd_test_write(test, md, lba, seed[lba / 16]);
		KUNIT_ASSERT_EQ(test, dd_test_commit(test, md), 0);
		if (i == 1000)
			used = dd_test_stats(md).metadata_used;
	}
	/* the last commit's frees come back at the one after it */
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).data_used, nr_lba + 1);
	KUNIT_ASSERT_EQ(test, dd_test_commit(test, md), 0);
	/*
	 * By then every LBA is mapped and the data allocator has been round
	 * once, so every leaf exists: overwrites take no more space.
	 */
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).metadata_used, used);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).mapped, nr_lba);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).data_used, nr_lba);

	for (pass = 0; pass < 2; pass++) {
		for (i = 0; i < nr_lba; i++) {
			dd_test_expect_map(test, md, i * 16, pba[i]);
			dd_test_expect_fp(test, md, pba[i], seed[i]);
			KUNIT_EXPECT_EQ(test,
					dd_test_refcount(test, md, pba[i]), 1);
		}
		txn = dd_test_stats(md).transaction_id;
		dd_test_md_close(test, md);
		md = dd_test_md_open(test, bdev, cfg);
		KUNIT_EXPECT_EQ(test, dd_test_stats(md).metadata_used, used);
		/* format, the commits, the one more, a load's each */
		KUNIT_EXPECT_EQ(test, txn, commits + 2 + pass);
		KUNIT_EXPECT_EQ(test, dd_test_stats(md).transaction_id, txn + 1);
	}
}

/* What a target keeps beside the metadata, for dd_md_save. */
#define DD_TEST_SAVED_WORDS	600	/* more than one leaf of words */
#define DD_TEST_LAYOUT		0x54534554	/* "TEST" */

static int dd_test_saved_refusals;

static int dd_test_saved_ok(void *ctx, const struct dd_md_saved *s,
			    const struct dd_space *live, const char **why)
{
	/* as the target sees it: the live blocks are loaded already */
	if (!dd_space_is_used(live, 0))
		return -EINVAL;
	*why = "refused by the test";
	return dd_test_saved_refusals ? -EILSEQ : 0;
}

static struct dd_md_saved *dd_test_saved(struct kunit *test,
					 struct dd_md_config *cfg)
{
	struct dd_md_saved *s = kunit_kzalloc(test, sizeof(*s), GFP_KERNEL);

	KUNIT_ASSERT_NOT_NULL(test, s);
	s->nr_words = DD_TEST_SAVED_WORDS;
	s->words = kunit_kcalloc(test, s->nr_words, sizeof(u64), GFP_KERNEL);
	KUNIT_ASSERT_NOT_NULL(test, s->words);
	s->head[0] = DD_TEST_LAYOUT;
	cfg->saved = s;
	cfg->saved_ok = dd_test_saved_ok;
	dd_test_saved_refusals = 0;
	return s;
}

/* Empty again, as a target hands it to an open. */
static void dd_test_saved_clear(struct dd_md_saved *s)
{
	memset(s->words, 0, s->nr_words * sizeof(u64));
	memset(s->head, 0, sizeof(s->head));
	s->head[0] = DD_TEST_LAYOUT;
	s->loaded = false;
	s->why = NULL;
}

/* Close after saving @s filled with a pattern that starts at @seed. */
static void dd_test_save_close(struct kunit *test, struct dd_metadata *md,
			       struct dd_md_saved *s, u64 seed)
{
	u64 i;

	for (i = 0; i < s->nr_words; i++)
		s->words[i] = i < 508 ? seed + i : 0;	/* leaf 2 absent */
	s->head[1] = seed;
	KUNIT_ASSERT_EQ(test, dd_md_save(md, s), 0);
	/* the save describes this state: nothing may change it any more */
	KUNIT_EXPECT_EQ(test, dd_test_commit(test, md), -EROFS);
	dd_test_md_close(test, md);
}

static void dd_test_expect_saved(struct kunit *test,
				 const struct dd_md_saved *s, u64 seed)
{
	u64 i;

	KUNIT_ASSERT_TRUE(test, s->loaded);
	KUNIT_EXPECT_EQ(test, s->head[0], DD_TEST_LAYOUT);
	KUNIT_EXPECT_EQ(test, s->head[1], seed);
	for (i = 0; i < s->nr_words; i++)
		KUNIT_EXPECT_EQ(test, s->words[i], i < 508 ? seed + i : 0);
}

/*
 * A clean close saves the allocation state and the target's words; the
 * next open loads them instead of visiting every live block, to the
 * same state, and its commit drops the save again.
 */
static void dd_md_test_saved(struct kunit *test)
{
	struct block_device *bdev = dd_test_dev_open(test);
	struct dd_md_config *cfg = dd_test_cfg(test, 1000, 100);
	struct dd_md_saved *s = dd_test_saved(test, cfg);
	struct dd_metadata *md = dd_test_md_open(test, bdev, cfg);
	struct dd_test_events *ev = dd_test_ev(cfg);
	u8 *raw = kunit_kmalloc(test, DD_BLOCK_SIZE, GFP_KERNEL);
	struct dd_md_stats st, st2;
	u64 hole;

	KUNIT_ASSERT_NOT_NULL(test, raw);
	KUNIT_EXPECT_FALSE(test, s->loaded);	/* formatted: nothing saved */
	dd_test_write(test, md, 1, 1);
	hole = dd_test_write(test, md, 2, 2);
	dd_test_write(test, md, 3, 3);
	dd_test_share(test, md, 4, 0);
	dd_test_write(test, md, 2, 5);		/* frees the block of lba 2 */
	KUNIT_ASSERT_EQ(test, dd_test_commit(test, md), 0);
	st = dd_test_stats(md);
	dd_test_save_close(test, md, s, 1000);
	dd_test_sb_slot(test, bdev, raw);
	KUNIT_EXPECT_NE(test, get_unaligned_le64(raw + DD_SB_OFF_SAVED_ROOT), 0);

	/* read-only: loaded, and the save stays named */
	dd_test_saved_clear(s);
	ev->visited = 0;
	cfg->read_only = true;
	md = dd_test_md_open(test, bdev, cfg);
	dd_test_expect_saved(test, s, 1000);
	KUNIT_EXPECT_EQ(test, ev->visited, 0);
	dd_test_md_close(test, md);
	cfg->read_only = false;

	dd_test_saved_clear(s);
	md = dd_test_md_open(test, bdev, cfg);
	dd_test_expect_saved(test, s, 1000);
	KUNIT_EXPECT_NULL(test, s->why);
	KUNIT_EXPECT_EQ(test, ev->visited, 0);
	st2 = dd_test_stats(md);
	KUNIT_EXPECT_EQ(test, st2.mapped, st.mapped);
	KUNIT_EXPECT_EQ(test, st2.data_live, st.data_live);
	/* the freed block cooled off: free after the load, as after a walk */
	KUNIT_EXPECT_EQ(test, st2.data_used, st.data_live);
	/* the save's own blocks left with the load's commit */
	KUNIT_EXPECT_EQ(test, st2.metadata_used, st.metadata_used);
	dd_test_sb_slot(test, bdev, raw);
	KUNIT_EXPECT_EQ(test, get_unaligned_le64(raw + DD_SB_OFF_SAVED_ROOT), 0);
	dd_test_expect_map(test, md, 4, 0);
	/* the allocator came back with its hole, and only that */
	KUNIT_EXPECT_EQ(test, dd_test_alloc(test, md), hole);
	KUNIT_EXPECT_EQ(test, dd_test_alloc(test, md), 4);
	dd_test_md_close(test, md);

	/* no save named: a rebuild from the live blocks */
	dd_test_saved_clear(s);
	ev->visited = 0;
	md = dd_test_md_open(test, bdev, cfg);
	KUNIT_EXPECT_FALSE(test, s->loaded);
	KUNIT_EXPECT_EQ(test, ev->visited, 3);
	dd_test_save_close(test, md, s, 2000);
}

/*
 * An open that must not load the save: the three live blocks of
 * dd_md_test_saved_refused are visited, from a clean slate.
 */
static void dd_test_expect_rebuilt(struct kunit *test,
				   struct block_device *bdev,
				   struct dd_md_config *cfg, struct dd_md_saved *s)
{
	struct dd_test_events *ev = dd_test_ev(cfg);
	struct dd_metadata *md;
	u64 layout = s->head[0];

	dd_test_saved_clear(s);
	s->head[0] = layout;
	ev->visited = 0;
	md = dd_test_md_open(test, bdev, cfg);
	KUNIT_EXPECT_FALSE(test, s->loaded);
	KUNIT_EXPECT_NOT_NULL(test, s->why);
	KUNIT_EXPECT_EQ(test, ev->visited, 3);
	KUNIT_EXPECT_EQ(test, s->words[5], 0);	/* wiped for the rebuild */
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).data_used, 3);
	dd_test_md_close(test, md);
}

/* Every save that does not fit the open falls back to the rebuild. */
static void dd_md_test_saved_refused(struct kunit *test)
{
	struct block_device *bdev = dd_test_dev_open(test);
	struct dd_md_config *cfg = dd_test_cfg(test, 1000, 100);
	struct dd_md_saved *s = dd_test_saved(test, cfg);
	struct dd_metadata *md = dd_test_md_open(test, bdev, cfg);
	u8 *raw = kunit_kmalloc(test, DD_BLOCK_SIZE, GFP_KERNEL);
	u64 words;

	KUNIT_ASSERT_NOT_NULL(test, raw);
	dd_test_write(test, md, 1, 1);
	dd_test_write(test, md, 2, 2);
	KUNIT_ASSERT_EQ(test, dd_test_commit(test, md), 0);
	/* something left to commit: no save */
	dd_test_write(test, md, 3, 3);
	KUNIT_EXPECT_EQ(test, dd_md_save(md, s), -EBUSY);
	KUNIT_ASSERT_EQ(test, dd_test_commit(test, md), 0);
	dd_test_save_close(test, md, s, 1);
	dd_test_sb_slot(test, bdev, raw);
	words = get_unaligned_le64(raw + DD_SB_OFF_SAVED_WORDS);

	cfg->read_only = true;	/* so that every open finds the same save */
	/* the target refuses its part */
	dd_test_saved_refusals = 1;
	dd_test_expect_rebuilt(test, bdev, cfg, s);
	dd_test_saved_refusals = 0;

	/* another layout of the target's words */
	s->head[0] = DD_TEST_LAYOUT + 1;
	dd_test_expect_rebuilt(test, bdev, cfg, s);

	/* other sizes */
	s->nr_words--;
	dd_test_expect_rebuilt(test, bdev, cfg, s);
	s->nr_words++;

	/* named by another superblock than the one it was written with */
	dd_test_patch_sb(test, bdev, 16, get_unaligned_le64(raw + 16) + 2, 8);
	dd_test_expect_rebuilt(test, bdev, cfg, s);
	dd_test_patch_sb(test, bdev, 16, get_unaligned_le64(raw + 16), 8);

	/* a length that does not match the layout */
	dd_test_patch_sb(test, bdev, DD_SB_OFF_SAVED_WORDS, words + 1, 8);
	dd_test_expect_rebuilt(test, bdev, cfg, s);
	dd_test_patch_sb(test, bdev, DD_SB_OFF_SAVED_WORDS, words, 8);

	/* intact again: loads */
	dd_test_saved_clear(s);
	md = dd_test_md_open(test, bdev, cfg);
	dd_test_expect_saved(test, s, 1);
	dd_test_md_close(test, md);
}

/* ------------------------------------------------------------------ */
/* the journal */

/*
 * What a flush does with the journal: one append of the changes. The
 * group handed with it ends once, when the append's last block is
 * written.
 */
static void dd_test_append(struct kunit *test, struct dd_metadata *md)
{
	struct dd_test_group t;
	struct dd_journal_batch b;

	dd_test_group_init(&t, 1);
	KUNIT_ASSERT_EQ(test, dd_md_journal_take(md, &b), 0);
	b.notify = &t.g;
	KUNIT_ASSERT_EQ(test, dd_md_journal_write(md, &b), 0);
	KUNIT_EXPECT_EQ(test, t.calls, 1);
	KUNIT_EXPECT_FALSE(test, t.failed);
}

/* The block that holds sequence number epoch + @k, from the superblock. */
static u64 dd_test_journal_block(struct kunit *test, struct block_device *bdev,
				 u64 k)
{
	u8 *sb = kunit_kmalloc(test, DD_BLOCK_SIZE, GFP_KERNEL);
	u64 start, n, seq;

	KUNIT_ASSERT_NOT_NULL(test, sb);
	dd_test_sb_slot(test, bdev, sb);
	start = get_unaligned_le64(sb + DD_SB_OFF_JOURNAL_START);
	n = get_unaligned_le64(sb + DD_SB_OFF_JOURNAL_START + 8);
	seq = get_unaligned_le64(sb + DD_SB_OFF_JOURNAL_SEQ) + k;
	kunit_kfree(test, sb);
	return start + do_div(seq, n);
}

/*
 * Shares and zero blocks into leaves the running transaction already
 * wrote are made in place with the metadata lock shared, also over a
 * block that keeps a reference; the first share after a commit (it
 * copies the leaves) and a change that frees a block take the lock
 * exclusive. Either way the result, and what the journal replays after a
 * crash, are the same.
 */
static void dd_md_test_in_place(struct kunit *test)
{
	struct block_device *bdev = dd_test_dev_open(test);
	struct dd_md_config *cfg = dd_test_cfg(test, 1000, 100);
	struct dd_metadata *md = dd_test_md_open(test, bdev, cfg);
	struct dd_test_events *ev = dd_test_ev(cfg);
	struct dd_md_dup d[3] = {};
	u8 fp[3][DD_FP_SIZE] = {};
	struct dd_md_stats st;
	struct dd_md_freed f;
	unsigned int done = 0;
	u64 p0, p1, p2;

	p0 = dd_test_write(test, md, 0, 1);
	p1 = dd_test_write(test, md, 1, 2);
	p2 = dd_test_write(test, md, 2, 3);
	/* p1 and p2 in place: p0 copied the leaves into the transaction */
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).in_place_changes, 2);
	KUNIT_ASSERT_EQ(test, dd_test_commit(test, md), 0);

	/* after a commit: copies the leaves again */
	KUNIT_EXPECT_EQ(test, dd_test_share_known(test, md, 10, p0), 0);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).in_place_changes, 2);
	KUNIT_EXPECT_EQ(test, dd_test_share_known(test, md, 11, p0), 0);
	KUNIT_EXPECT_EQ(test, dd_test_share_known(test, md, 12, p2), 0);
	/* over p2, which keeps the reference of block 2 */
	KUNIT_EXPECT_EQ(test, dd_test_share_known(test, md, 12, p0), 0);
	/* a block that already shares it */
	KUNIT_EXPECT_EQ(test, dd_test_share_known(test, md, 11, p0), 0);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).in_place_changes, 6);
	KUNIT_EXPECT_EQ(test, dd_test_refcount(test, md, p0), 4);
	KUNIT_EXPECT_EQ(test, dd_test_refcount(test, md, p2), 1);
	/* over the last reference of p1, which is freed in place */
	KUNIT_EXPECT_EQ(test, dd_test_share_known(test, md, 1, p0), 0);
	KUNIT_EXPECT_EQ(test, ev->freed, 1);
	KUNIT_EXPECT_EQ(test, ev->freed_pba[0], p1);
	dd_test_fp(fp[0], 2);
	KUNIT_EXPECT_MEMEQ(test, ev->freed_fp[0], fp[0], DD_FP_SIZE);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).in_place_changes, 7);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).data_live, 2);

	/* a batch with a soft miss between two shares made in place */
	KUNIT_ASSERT_EQ(test, dd_md_get_fingerprint(md, p2, fp[0]), 0);
	dd_test_fp(fp[1], 99);
	KUNIT_ASSERT_EQ(test, dd_md_get_fingerprint(md, p0, fp[2]), 0);
	d[0] = (struct dd_md_dup){ .lba = 20, .fp = fp[0] };
	d[1] = (struct dd_md_dup){ .lba = 21, .fp = fp[1] };
	d[2] = (struct dd_md_dup){ .lba = 22, .fp = fp[2] };
	dd_md_map_duplicates(md, d, 3, &done, &f);
	KUNIT_EXPECT_EQ(test, done, 3);
	KUNIT_EXPECT_EQ(test, d[0].r, 0);
	KUNIT_EXPECT_EQ(test, d[0].pba, p2);
	KUNIT_EXPECT_EQ(test, d[1].r, -ENOENT);
	KUNIT_EXPECT_EQ(test, d[2].r, 0);
	KUNIT_EXPECT_EQ(test, d[2].pba, p0);
	st = dd_test_stats(md);
	KUNIT_EXPECT_EQ(test, st.in_place_changes, 9);
	KUNIT_EXPECT_EQ(test, st.duplicate_writes, 8);
	KUNIT_EXPECT_EQ(test, st.mapped, 8);

	/*
	 * Zero blocks, in place: over an unmapped block, and over blocks
	 * whose block keeps a reference (p0; p2, held twice).
	 */
	KUNIT_EXPECT_EQ(test, dd_test_map_zero(test, md, 30), 0);
	KUNIT_EXPECT_EQ(test, dd_test_map_zero(test, md, 22), 0);
	KUNIT_EXPECT_EQ(test, dd_test_map_zero(test, md, 20), 0);
	st = dd_test_stats(md);
	KUNIT_EXPECT_EQ(test, st.in_place_changes, 12);
	KUNIT_EXPECT_EQ(test, st.zero_writes, 3);
	KUNIT_EXPECT_EQ(test, st.mapped, 6);
	KUNIT_EXPECT_EQ(test, dd_test_refcount(test, md, p2), 1);
	/* the last reference of p2: freed in place too */
	KUNIT_EXPECT_EQ(test, dd_test_map_zero(test, md, 2), 0);
	KUNIT_EXPECT_EQ(test, ev->freed, 2);
	KUNIT_EXPECT_EQ(test, ev->freed_pba[1], p2);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).in_place_changes, 13);
	dd_test_append(test, md);
	dd_test_md_close(test, md);		/* a crash after the append */

	md = dd_test_md_open(test, bdev, cfg);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).journal_replayed, 1);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).mapped, 5);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).duplicate_writes, 8);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).zero_writes, 4);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).data_live, 1);
	KUNIT_EXPECT_EQ(test, dd_test_refcount(test, md, p0), 5);
	KUNIT_EXPECT_EQ(test, dd_test_refcount(test, md, p1), 0);
	KUNIT_EXPECT_EQ(test, dd_test_refcount(test, md, p2), 0);
	dd_test_expect_map(test, md, 0, p0);
	dd_test_expect_map(test, md, 1, p0);
	dd_test_expect_unmapped(test, md, 2);
	dd_test_expect_map(test, md, 10, p0);
	dd_test_expect_map(test, md, 11, p0);
	dd_test_expect_map(test, md, 12, p0);
	dd_test_expect_unmapped(test, md, 20);
	dd_test_expect_unmapped(test, md, 21);
	dd_test_expect_unmapped(test, md, 22);
	dd_test_expect_unmapped(test, md, 30);
}

/*
 * A batch of shares is made in runs, each under one hold of the lock for
 * changes in place (DD_SHARE_RUN): a batch longer than a run; a soft miss
 * inside a run; a share whose old block an earlier share of its run left
 * with one reference, which is held again and frees that block in place,
 * ending the call before the rest of the batch. A commit writes every
 * leaf the runs changed (each marked dirty once per run).
 */
static void dd_md_test_share_runs(struct kunit *test)
{
	struct block_device *bdev = dd_test_dev_open(test);
	struct dd_md_config *cfg = dd_test_cfg(test, 1000, 100);
	struct dd_metadata *md = dd_test_md_open(test, bdev, cfg);
	u8 fp[3][DD_FP_SIZE], old[DD_FP_SIZE];
	struct dd_md_dup d[20];
	struct dd_md_freed f;
	unsigned int i, done = 0;
	u64 p0, p1, p2, in_place;

	p0 = dd_test_write(test, md, 0, 1);
	p1 = dd_test_write(test, md, 1, 2);
	p2 = dd_test_write(test, md, 2, 3);
	dd_test_share(test, md, 50, p1);
	dd_test_share(test, md, 51, p1);
	dd_test_share(test, md, 1, p2);		/* p1 keeps 50 and 51 */
	dd_test_fp(fp[0], 1);
	dd_test_fp(fp[1], 3);
	dd_test_fp(fp[2], 99);			/* nobody's */
	dd_test_fp(old, 2);

	/* longer than a run, every share in place */
	in_place = dd_test_stats(md).in_place_changes;
	for (i = 0; i < ARRAY_SIZE(d); i++)
		d[i] = (struct dd_md_dup){ .lba = 100 + i, .fp = fp[0],
					   .leaf = p0 / DD_FP_PER_LEAF };
	dd_md_map_duplicates(md, d, ARRAY_SIZE(d), &done, &f);
	KUNIT_EXPECT_EQ(test, done, ARRAY_SIZE(d));
	for (i = 0; i < ARRAY_SIZE(d); i++) {
		KUNIT_EXPECT_EQ(test, d[i].r, 0);
		KUNIT_EXPECT_EQ(test, d[i].pba, p0);
	}
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).in_place_changes,
			in_place + ARRAY_SIZE(d));
	KUNIT_EXPECT_EQ(test, dd_test_refcount(test, md, p0),
			1 + ARRAY_SIZE(d));

	/* 50's share leaves p1 with one reference, which 51's drops */
	d[0] = (struct dd_md_dup){ .lba = 40, .fp = fp[1],
				   .leaf = p2 / DD_FP_PER_LEAF };
	d[1] = (struct dd_md_dup){ .lba = 41, .fp = fp[2] };
	d[2] = (struct dd_md_dup){ .lba = 50, .fp = fp[0],
				   .leaf = p0 / DD_FP_PER_LEAF };
	d[3] = d[2];
	d[3].lba = 51;
	d[4] = d[0];
	d[4].lba = 42;
	in_place = dd_test_stats(md).in_place_changes;
	dd_md_map_duplicates(md, d, 5, &done, &f);
	KUNIT_EXPECT_EQ(test, done, 4);
	KUNIT_EXPECT_EQ(test, d[0].r, 0);
	KUNIT_EXPECT_EQ(test, d[0].pba, p2);
	KUNIT_EXPECT_EQ(test, d[1].r, -ENOENT);
	KUNIT_EXPECT_EQ(test, d[2].r, 0);
	KUNIT_EXPECT_EQ(test, d[3].r, 1);
	KUNIT_EXPECT_EQ(test, f.pba, p1);
	KUNIT_EXPECT_MEMEQ(test, f.fp, old, DD_FP_SIZE);
	/* all in place; 42's share was not made */
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).in_place_changes,
			in_place + 3);
	dd_test_expect_unmapped(test, md, 42);
	dd_md_map_duplicates(md, d + 4, 1, &done, &f);
	KUNIT_EXPECT_EQ(test, done, 1);
	KUNIT_EXPECT_EQ(test, d[4].r, 0);
	KUNIT_ASSERT_EQ(test, dd_test_commit(test, md), 0);
	dd_test_md_close(test, md);

	md = dd_test_md_open(test, bdev, cfg);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).journal_replayed, 0);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).data_live, 2);
	KUNIT_EXPECT_EQ(test, dd_test_refcount(test, md, p0),
			3 + ARRAY_SIZE(d));
	KUNIT_EXPECT_EQ(test, dd_test_refcount(test, md, p1), 0);
	KUNIT_EXPECT_EQ(test, dd_test_refcount(test, md, p2), 4);
	for (i = 0; i < ARRAY_SIZE(d); i++)
		dd_test_expect_map(test, md, 100 + i, p0);
	dd_test_expect_map(test, md, 40, p2);
	dd_test_expect_unmapped(test, md, 41);
	dd_test_expect_map(test, md, 42, p2);
	dd_test_expect_map(test, md, 50, p0);
	dd_test_expect_map(test, md, 51, p0);
	dd_test_expect_map(test, md, 1, p2);
}

/*
 * Verify binds a share to the holder whose bytes it compared (d.only):
 * with two live holders of one fingerprint in a leaf, the second is
 * taken, on the exclusive path (the first change after a commit) and in
 * place; a block that does not hold the fingerprint is a soft miss that
 * changes nothing; without d.only the first holder is taken.
 */
static void dd_md_test_share_only(struct kunit *test)
{
	struct block_device *bdev = dd_test_dev_open(test);
	struct dd_md_config *cfg = dd_test_cfg(test, 1000, 100);
	struct dd_metadata *md = dd_test_md_open(test, bdev, cfg);
	u64 leaf, p0, p1, p2, lba, in_place;
	u8 fp[DD_FP_SIZE];
	struct dd_md_freed f;
	struct dd_md_dup d;
	unsigned int done;

	p0 = dd_test_write(test, md, 0, 7);
	p1 = dd_test_write(test, md, 1, 7);
	p2 = dd_test_write(test, md, 2, 8);
	leaf = p1 / DD_FP_PER_LEAF;
	KUNIT_ASSERT_EQ(test, p0 / DD_FP_PER_LEAF, leaf);
	KUNIT_ASSERT_EQ(test, dd_test_commit(test, md), 0);
	dd_test_fp(fp, 7);
	in_place = dd_test_stats(md).in_place_changes;
	for (lba = 10; lba < 12; lba++) {
		d = (struct dd_md_dup){ .lba = lba, .leaf = leaf, .fp = fp,
					.only = p1 + 1 };
		dd_md_map_duplicates(md, &d, 1, &done, &f);
		KUNIT_EXPECT_EQ(test, done, 1);
		KUNIT_EXPECT_EQ(test, d.r, 0);
		KUNIT_EXPECT_EQ(test, d.pba, p1);
		dd_test_expect_map(test, md, lba, p1);
	}
	/* the first went exclusive, the second in place */
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).in_place_changes, in_place + 1);
	KUNIT_EXPECT_EQ(test, dd_test_refcount(test, md, p1), 3);
	KUNIT_EXPECT_EQ(test, dd_test_refcount(test, md, p0), 1);

	d = (struct dd_md_dup){ .lba = 12, .leaf = leaf, .fp = fp,
				.only = p2 + 1 };
	dd_md_map_duplicates(md, &d, 1, &done, &f);
	KUNIT_EXPECT_EQ(test, d.r, -ENOENT);
	dd_test_expect_unmapped(test, md, 12);
	KUNIT_EXPECT_EQ(test, dd_test_refcount(test, md, p2), 1);

	KUNIT_EXPECT_EQ(test, dd_test_share_known(test, md, 12, p0), 0);
	KUNIT_EXPECT_EQ(test, dd_test_refcount(test, md, p0), 2);
}

/*
 * New blocks whose leaves the running transaction already wrote are
 * recorded in place, and may free the block they replace; a share finds
 * them by their record, and a replay after a crash finds them all.
 */
static void dd_md_test_new_in_place(struct kunit *test)
{
	struct block_device *bdev = dd_test_dev_open(test);
	struct dd_md_config *cfg = dd_test_cfg(test, 1000, 100);
	struct dd_metadata *md = dd_test_md_open(test, bdev, cfg);
	struct dd_test_events *ev = dd_test_ev(cfg);
	u8 fp[DD_FP_SIZE], got[DD_FP_SIZE];
	struct dd_md_stats st;
	u64 p0, p1, p2, p3;

	p0 = dd_test_write(test, md, 0, 1);	/* copies the leaves */
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).in_place_changes, 0);
	p1 = dd_test_write(test, md, 1, 2);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).in_place_changes, 1);
	KUNIT_ASSERT_EQ(test, dd_test_commit(test, md), 0);

	p2 = dd_test_write(test, md, 2, 3);	/* copies them again */
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).in_place_changes, 1);
	/* over the last reference of p1 */
	p3 = dd_test_write(test, md, 1, 4);
	st = dd_test_stats(md);
	KUNIT_EXPECT_EQ(test, st.in_place_changes, 2);
	KUNIT_EXPECT_EQ(test, st.unique_writes, 4);
	KUNIT_EXPECT_EQ(test, st.data_live, 3);
	KUNIT_EXPECT_EQ(test, st.mapped, 3);
	KUNIT_EXPECT_EQ(test, ev->freed, 1);
	KUNIT_EXPECT_EQ(test, ev->freed_pba[0], p1);
	dd_test_fp(fp, 2);
	KUNIT_EXPECT_MEMEQ(test, ev->freed_fp[0], fp, DD_FP_SIZE);
	KUNIT_EXPECT_EQ(test, dd_test_share_known(test, md, 5, p3), 0);
	KUNIT_EXPECT_EQ(test, dd_test_refcount(test, md, p3), 2);
	dd_test_append(test, md);
	dd_test_md_close(test, md);		/* a crash after the append */

	md = dd_test_md_open(test, bdev, cfg);
	st = dd_test_stats(md);
	KUNIT_EXPECT_EQ(test, st.journal_replayed, 1);
	KUNIT_EXPECT_EQ(test, st.unique_writes, 4);
	KUNIT_EXPECT_EQ(test, st.data_live, 3);
	KUNIT_EXPECT_EQ(test, st.mapped, 4);
	KUNIT_EXPECT_EQ(test, dd_test_refcount(test, md, p1), 0);
	KUNIT_EXPECT_EQ(test, dd_test_refcount(test, md, p3), 2);
	dd_test_fp(fp, 4);
	KUNIT_EXPECT_EQ(test, dd_md_get_fingerprint(md, p3, got), 0);
	KUNIT_EXPECT_MEMEQ(test, got, fp, DD_FP_SIZE);
	dd_test_expect_map(test, md, 0, p0);
	dd_test_expect_map(test, md, 1, p3);
	dd_test_expect_map(test, md, 2, p2);
	dd_test_expect_map(test, md, 5, p3);
}

/*
 * A change that moves only a count (a zero block over an unmapped block,
 * a share of the block the logical block already maps) still needs an
 * append, so that the counts a flush made durable are the ones replayed.
 */
static void dd_md_test_journal_counts_only(struct kunit *test)
{
	struct block_device *bdev = dd_test_dev_open(test);
	struct dd_md_config *cfg = dd_test_cfg(test, 1000, 100);
	struct dd_metadata *md = dd_test_md_open(test, bdev, cfg);
	struct dd_journal_batch b;
	struct dd_md_stats st;
	u64 pba;

	pba = dd_test_write(test, md, 0, 1);
	dd_test_share(test, md, 1, pba);
	KUNIT_ASSERT_EQ(test, dd_test_commit(test, md), 0);
	KUNIT_EXPECT_FALSE(test, dd_md_journal_pending(md));
	KUNIT_EXPECT_EQ(test, dd_md_journal_take(md, &b), -ENODATA);

	KUNIT_EXPECT_EQ(test, dd_test_map_zero(test, md, 5), 0);
	KUNIT_EXPECT_TRUE(test, dd_md_journal_pending(md));
	dd_test_append(test, md);
	KUNIT_EXPECT_FALSE(test, dd_md_journal_pending(md));
	/* a share of the block already mapped: taken and dropped at once */
	KUNIT_EXPECT_EQ(test, dd_test_share_known(test, md, 1, pba), 0);
	KUNIT_EXPECT_EQ(test, dd_test_share_known(test, md, 1, pba), 0);
	KUNIT_EXPECT_TRUE(test, dd_md_journal_pending(md));
	dd_test_append(test, md);
	st = dd_test_stats(md);
	dd_test_md_close(test, md);		/* a crash after the appends */

	md = dd_test_md_open(test, bdev, cfg);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).journal_replayed, 2);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).zero_writes, st.zero_writes);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).zero_writes, 1);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).duplicate_writes,
			st.duplicate_writes);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).mapped, 2);
	KUNIT_EXPECT_EQ(test, dd_test_refcount(test, md, pba), 2);
}

/*
 * Two checkpoints with nothing appended between them still start two
 * epochs. With the newer slot damaged, the older one is used, and an
 * append made after the newer checkpoint is not replayed onto it: the
 * older state lacks what that checkpoint added (here the block the
 * append shares, which would be left mapped with no owner of its own).
 */
static void dd_md_test_journal_epochs(struct kunit *test)
{
	struct block_device *bdev = dd_test_dev_open(test);
	struct dd_md_config *cfg = dd_test_cfg(test, 1000, 100);
	struct dd_metadata *md = dd_test_md_open(test, bdev, cfg);
	u8 *raw = kunit_kmalloc(test, DD_BLOCK_SIZE, GFP_KERNEL);
	const struct dd_superblock *sb = (const void *)raw;
	u64 pba0, pba1, older, newer, epoch;

	KUNIT_ASSERT_NOT_NULL(test, raw);
	pba0 = dd_test_write(test, md, 0, 10);
	KUNIT_ASSERT_EQ(test, dd_test_commit(test, md), 0);
	older = dd_test_sb_slot(test, bdev, raw);
	epoch = le64_to_cpu(sb->journal_seq);
	pba1 = dd_test_write(test, md, 1, 11);	/* committed, never appended */
	KUNIT_ASSERT_EQ(test, dd_test_commit(test, md), 0);
	newer = dd_test_sb_slot(test, bdev, raw);
	KUNIT_EXPECT_NE(test, newer, older);
	KUNIT_EXPECT_EQ(test, le64_to_cpu(sb->journal_seq), epoch + 1);
	dd_test_share(test, md, 2, pba1);
	dd_test_append(test, md);
	dd_test_md_close(test, md);		/* a crash */

	cfg->read_only = true;
	md = dd_test_md_open(test, bdev, cfg);
	dd_test_expect_map(test, md, 2, pba1);	/* the newer state and its append */
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).journal_replayed, 1);
	dd_test_md_close(test, md);

	dd_test_flip_bit(test, bdev, newer, 150, 3);
	md = dd_test_md_open(test, bdev, cfg);
	dd_test_expect_map(test, md, 0, pba0);
	dd_test_expect_unmapped(test, md, 1);
	dd_test_expect_unmapped(test, md, 2);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).journal_replayed, 0);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).mapped, 1);
	dd_test_md_close(test, md);
}

/* The epoch (journal_seq) each superblock slot names; @raw is scratch. */
static void dd_test_slot_epochs(struct kunit *test, struct block_device *bdev,
				u8 *raw, u64 *epoch)
{
	const struct dd_superblock *sb = (const void *)raw;
	u64 slot;

	for (slot = 0; slot < DD_SB_SLOTS; slot++) {
		dd_test_read_block(test, bdev, slot, raw);
		KUNIT_ASSERT_TRUE(test, dd_block_csum_ok(raw));
		epoch[slot] = le64_to_cpu(sb->journal_seq);
	}
}

/*
 * A target before 1.9.0 could leave both slots naming one epoch. The
 * first read-write open separates them: its checkpoint starts the epoch
 * two rings past the one read, so no append made from then on can be
 * replayed onto the older slot.
 */
static void dd_md_test_journal_shared_epochs(struct kunit *test)
{
	struct block_device *bdev = dd_test_dev_open(test);
	struct dd_md_config *cfg = dd_test_cfg(test, 1000, 100);
	struct dd_metadata *md = dd_test_md_open(test, bdev, cfg);
	u8 *raw = kunit_kmalloc(test, DD_BLOCK_SIZE, GFP_KERNEL);
	const struct dd_superblock *sb = (const void *)raw;
	u64 epoch[DD_SB_SLOTS], shared, pba1;

	KUNIT_ASSERT_NOT_NULL(test, raw);
	dd_test_write(test, md, 0, 10);
	KUNIT_ASSERT_EQ(test, dd_test_commit(test, md), 0);
	dd_test_sb_slot(test, bdev, raw);
	shared = le64_to_cpu(sb->journal_seq);
	pba1 = dd_test_write(test, md, 1, 11);
	KUNIT_ASSERT_EQ(test, dd_test_commit(test, md), 0);
	dd_test_md_close(test, md);
	dd_test_patch_sb(test, bdev, offsetof(struct dd_superblock, journal_seq),
			 shared, 8);
	dd_test_slot_epochs(test, bdev, raw, epoch);
	KUNIT_EXPECT_EQ(test, epoch[0], shared);
	KUNIT_EXPECT_EQ(test, epoch[1], shared);

	md = dd_test_md_open(test, bdev, cfg);
	dd_test_expect_map(test, md, 1, pba1);
	dd_test_md_close(test, md);
	dd_test_slot_epochs(test, bdev, raw, epoch);
	KUNIT_EXPECT_NE(test, epoch[0], epoch[1]);
	KUNIT_EXPECT_EQ(test, max(epoch[0], epoch[1]),
			shared + 2 * le64_to_cpu(sb->journal_blocks));
}

/*
 * A crash after two appends and a change never appended: the next open
 * replays the appends onto the last commit and checkpoints the result;
 * the change that no flush covered is gone. A read-only open first sees
 * the same, from memory, and writes nothing.
 */
static void dd_md_test_journal_replay(struct kunit *test)
{
	struct block_device *bdev = dd_test_dev_open(test);
	struct dd_md_config *cfg = dd_test_cfg(test, 1000, 100);
	struct dd_metadata *md = dd_test_md_open(test, bdev, cfg);
	u32 (*crcs)[DD_TEST_DEV_BLOCKS];
	struct dd_md_stats st;
	u64 pba0, pba1, pba2, txn, got;

	crcs = kunit_kmalloc(test, 2 * sizeof(*crcs), GFP_KERNEL);
	KUNIT_ASSERT_NOT_NULL(test, crcs);
	pba0 = dd_test_write(test, md, 0, 10);
	KUNIT_ASSERT_EQ(test, dd_test_commit(test, md), 0);
	txn = dd_test_stats(md).transaction_id;
	pba1 = dd_test_write(test, md, 1, 11);
	dd_test_append(test, md);
	dd_test_share(test, md, 2, pba0);
	pba2 = dd_test_write(test, md, 0, 12);	/* drops a reference of pba0 */
	dd_test_append(test, md);
	dd_test_write(test, md, 3, 13);		/* never appended */
	st = dd_test_stats(md);
	KUNIT_EXPECT_EQ(test, st.transaction_id, txn);
	KUNIT_EXPECT_EQ(test, st.journal_used, 2);
	KUNIT_EXPECT_EQ(test, st.journal_appends, 2);
	dd_test_md_close(test, md);		/* a crash: nothing committed */

	cfg->read_only = true;
	dd_test_device_crcs(test, bdev, crcs[0]);
	md = dd_test_md_open(test, bdev, cfg);
	dd_test_expect_map(test, md, 0, pba2);
	dd_test_expect_map(test, md, 1, pba1);
	dd_test_expect_map(test, md, 2, pba0);
	dd_test_expect_unmapped(test, md, 3);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).mapped, 3);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).journal_replayed, 2);
	/* the blocks stored since the commit count, as after the replay */
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).data_used, 3);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).data_live, 3);
	dd_test_md_close(test, md);
	dd_test_device_crcs(test, bdev, crcs[1]);
	KUNIT_EXPECT_MEMEQ(test, crcs[0], crcs[1], sizeof(crcs[0]));

	cfg->read_only = false;
	md = dd_test_md_open(test, bdev, cfg);
	st = dd_test_stats(md);
	KUNIT_EXPECT_EQ(test, st.journal_replayed, 2);
	KUNIT_EXPECT_EQ(test, st.journal_used, 0);
	KUNIT_EXPECT_EQ(test, st.transaction_id, txn + 2);
	KUNIT_EXPECT_EQ(test, st.mapped, 3);
	KUNIT_EXPECT_EQ(test, st.data_live, 3);
	KUNIT_EXPECT_EQ(test, st.data_used, 3);
	KUNIT_EXPECT_EQ(test, dd_md_lookup(md, 0, &got, false), 0);
	KUNIT_EXPECT_EQ(test, got, pba2);
	dd_test_expect_map(test, md, 1, pba1);
	dd_test_expect_map(test, md, 2, pba0);
	dd_test_expect_unmapped(test, md, 3);
	KUNIT_EXPECT_EQ(test, dd_test_refcount(test, md, pba0), 1);
	dd_test_expect_fp(test, md, pba1, 11);
	dd_test_expect_fp(test, md, pba2, 12);
	dd_test_md_close(test, md);

	/* replayed once: the next open finds an empty journal */
	md = dd_test_md_open(test, bdev, cfg);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).journal_replayed, 0);
	dd_test_expect_map(test, md, 2, pba0);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).mapped, 3);
}

/*
 * Appends after a checkpoint of this kernel are marked unflushed (the
 * target writes them while their data is flushed), and replay checks
 * the data of the newest one only: with a block missing, that append is
 * dropped, read-only and read-write, and a read-write open leaves
 * nothing of it for the next. A data device that cannot be read fails
 * the open; without a verifier the append is applied as it is.
 */
static void dd_md_test_journal_unflushed(struct kunit *test)
{
	struct block_device *bdev = dd_test_dev_open(test);
	struct dd_md_config *cfg = dd_test_cfg(test, 1000, 100);
	struct dd_test_events *ev = dd_test_ev(cfg);
	struct dd_metadata *md = dd_test_md_open(test, bdev, cfg);
	u8 *raw = kunit_kmalloc(test, DD_BLOCK_SIZE, GFP_KERNEL);
	struct dd_journal_header *h = (void *)raw;
	const char *error;
	u64 pba0, pba1, pba2;

	KUNIT_ASSERT_NOT_NULL(test, raw);
	cfg->verify = dd_test_verify;
	pba0 = dd_test_write(test, md, 0, 10);
	dd_test_append(test, md);
	pba1 = dd_test_write(test, md, 1, 11);
	pba2 = dd_test_write(test, md, 2, 12);
	dd_test_share(test, md, 3, pba0);
	dd_test_append(test, md);
	KUNIT_ASSERT_LT(test, pba2, ARRAY_SIZE(ev->data_seed));
	ev->data_seed[pba0] = 10;
	ev->data_seed[pba1] = 11;
	ev->data_seed[pba2] = 12;
	dd_test_md_close(test, md);		/* a crash */

	dd_test_read_block(test, bdev, dd_test_journal_block(test, bdev, 1), raw);
	KUNIT_EXPECT_EQ(test, le32_to_cpu(h->flags), DD_JF_END | DD_JF_UNFLUSHED);
	dd_test_sb_slot(test, bdev, raw);
	KUNIT_EXPECT_EQ(test, get_unaligned_le32(raw + DD_SB_OFF_FLAGS),
			DD_SB_UNFLUSHED_APPENDS);

	/* every block there: both appends, the newest one checked */
	cfg->read_only = true;
	md = dd_test_md_open(test, bdev, cfg);
	KUNIT_EXPECT_EQ(test, ev->verified, 2);
	KUNIT_EXPECT_EQ(test, ev->verified_pba[0], pba1);
	KUNIT_EXPECT_EQ(test, ev->verified_pba[1], pba2);
	dd_test_expect_map(test, md, 2, pba2);
	dd_test_expect_map(test, md, 3, pba0);
	dd_test_md_close(test, md);

	/* one block of the newest append missing: it is dropped whole */
	ev->verified = 0;
	ev->data_seed[pba2] = 0;
	md = dd_test_md_open(test, bdev, cfg);
	KUNIT_EXPECT_EQ(test, ev->verified, 2);
	dd_test_expect_map(test, md, 0, pba0);
	dd_test_expect_unmapped(test, md, 1);
	dd_test_expect_unmapped(test, md, 2);
	dd_test_expect_unmapped(test, md, 3);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).journal_replayed, 1);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).journal_dropped, 1);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).mapped, 1);
	dd_test_md_close(test, md);

	/* the data device unreadable: no guess */
	ev->verify_error = -EIO;
	KUNIT_EXPECT_EQ(test, dd_test_try_open(bdev, cfg, &error), -EIO);
	ev->verify_error = 0;

	cfg->read_only = false;
	md = dd_test_md_open(test, bdev, cfg);
	dd_test_expect_unmapped(test, md, 1);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).mapped, 1);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).data_live, 1);
	dd_test_md_close(test, md);
	/* the dropped append is in an epoch no later open reads */
	cfg->verify = NULL;
	md = dd_test_md_open(test, bdev, cfg);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).journal_replayed, 0);
	dd_test_expect_unmapped(test, md, 2);
	KUNIT_EXPECT_EQ(test, dd_test_refcount(test, md, pba2), 0);
	dd_test_md_close(test, md);

	/* without a verifier the newest append is applied as it is */
	md = dd_test_md_open(test, bdev, cfg);
	pba1 = dd_test_write(test, md, 1, 99);
	dd_test_append(test, md);
	dd_test_md_close(test, md);
	md = dd_test_md_open(test, bdev, cfg);
	dd_test_expect_map(test, md, 1, pba1);
}

/*
 * An append torn by the crash (its block damaged) is not replayed, nor
 * anything after it; a block whose records are malformed under a valid
 * checksum is damage, and the open is refused.
 */
static void dd_md_test_journal_torn(struct kunit *test)
{
	struct block_device *bdev = dd_test_dev_open(test);
	struct dd_md_config *cfg = dd_test_cfg(test, 1000, 100);
	struct dd_metadata *md = dd_test_md_open(test, bdev, cfg);
	u8 *raw = kunit_kmalloc(test, DD_BLOCK_SIZE, GFP_KERNEL);
	const char *error;
	u64 pba0, b;

	KUNIT_ASSERT_NOT_NULL(test, raw);
	pba0 = dd_test_write(test, md, 0, 10);
	dd_test_append(test, md);
	dd_test_write(test, md, 1, 11);
	dd_test_append(test, md);
	dd_test_write(test, md, 2, 12);
	dd_test_append(test, md);
	dd_test_md_close(test, md);

	dd_test_flip_bit(test, bdev, dd_test_journal_block(test, bdev, 1),
			 100, 3);
	cfg->read_only = true;
	md = dd_test_md_open(test, bdev, cfg);
	dd_test_expect_map(test, md, 0, pba0);
	dd_test_expect_unmapped(test, md, 1);
	dd_test_expect_unmapped(test, md, 2);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).journal_replayed, 1);
	dd_test_md_close(test, md);

	/* an unknown record type, checksum fixed */
	b = dd_test_journal_block(test, bdev, 0);
	dd_test_read_block(test, bdev, b, raw);
	raw[DD_JOURNAL_HEADER_SIZE + 7] = 0x7f;
	put_unaligned_le32(dd_block_csum(raw), raw);
	dd_test_write_block(test, bdev, b, raw);
	KUNIT_EXPECT_EQ(test, dd_test_try_open(bdev, cfg, &error), -EILSEQ);
	cfg->read_only = false;
	KUNIT_EXPECT_EQ(test, dd_test_try_open(bdev, cfg, &error), -EILSEQ);
	KUNIT_EXPECT_STREQ(test, error,
			   "cannot replay the journal (see the lines above); run dedup check");
}

/*
 * Many appends with a commit whenever half the journal is used, as the
 * target does: the ring wraps past its end several times, an append
 * that does not fit the epoch is refused (the target then commits),
 * and a crash after the wraps replays what the last epoch appended.
 */
static void dd_md_test_journal_wrap(struct kunit *test)
{
	struct block_device *bdev = dd_test_dev_open(test);
	struct dd_md_config *cfg = dd_test_cfg(test, 1000, 3000);
	struct dd_metadata *md = dd_test_md_open(test, bdev, cfg);
	u64 total = dd_test_stats(md).journal_total, n = 5 * total + 7, i;
	u64 *pba = kunit_kcalloc(test, n, sizeof(u64), GFP_KERNEL);
	struct dd_journal_batch b;

	KUNIT_ASSERT_NOT_NULL(test, pba);
	KUNIT_ASSERT_EQ(test, total, DD_JOURNAL_MAKE_MIN);
	for (i = 0; i < n; i++) {
		pba[i] = dd_test_write(test, md, i, i);
		dd_test_append(test, md);
		if (dd_md_checkpoint_due(md))
			KUNIT_ASSERT_EQ(test, dd_test_commit(test, md), 0);
	}
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).journal_blocks_written, n);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).journal_used, n % (total / 2));
	dd_test_md_close(test, md);

	md = dd_test_md_open(test, bdev, cfg);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).journal_replayed,
			n % (total / 2));
	for (i = 0; i < n; i++)
		dd_test_expect_map(test, md, i, pba[i]);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).mapped, n);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).data_live, n);

	/* an epoch holds the ring at most: the append past it is refused */
	for (i = 0; i < total; i++) {
		dd_test_write(test, md, i, 7 * n + i);
		dd_test_append(test, md);
	}
	dd_test_write(test, md, 0, 9 * n);
	KUNIT_EXPECT_EQ(test, dd_md_journal_take(md, &b), -ENOSPC);
	KUNIT_EXPECT_EQ(test, dd_test_commit(test, md), 0);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).journal_used, 0);
	KUNIT_EXPECT_EQ(test, dd_md_journal_take(md, &b), -ENODATA);
}

/*
 * Appends of more blocks than the journal keeps spare (16): the first
 * fills new blocks, the second the spare ones and new ones again, and
 * replay finds every record of both, in order.
 */
static void dd_md_test_journal_many_blocks(struct kunit *test)
{
	struct block_device *bdev = dd_test_dev_open(test);
	struct dd_md_config *cfg = dd_test_cfg(test, 1000, 3000);
	struct dd_metadata *md = dd_test_md_open(test, bdev, cfg);
	u64 *pba = kunit_kcalloc(test, 1000, sizeof(u64), GFP_KERNEL);
	u64 i, used, first;

	KUNIT_ASSERT_NOT_NULL(test, pba);
	for (i = 0; i < 1000; i++)
		dd_test_write(test, md, i, i);
	dd_test_append(test, md);
	first = dd_test_stats(md).journal_used;
	/* 72 bytes of records per new block: more than 16 blocks */
	KUNIT_EXPECT_GT(test, first, 16);
	for (i = 0; i < 1000; i++)	/* each frees the block it replaces */
		pba[i] = dd_test_write(test, md, i, 5000 + i);
	dd_test_append(test, md);
	used = dd_test_stats(md).journal_used;
	KUNIT_EXPECT_GT(test, used - first, first);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).journal_appends, 2);
	dd_test_md_close(test, md);		/* a crash: nothing committed */

	md = dd_test_md_open(test, bdev, cfg);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).journal_replayed, used);
	for (i = 0; i < 1000; i++) {
		dd_test_expect_map(test, md, i, pba[i]);
		KUNIT_EXPECT_EQ(test, dd_test_refcount(test, md, pba[i]), 1);
	}
	dd_test_expect_fp(test, md, pba[999], 5999);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).mapped, 1000);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).data_live, 1000);
}

/*
 * Format version 1 (no journal) opens read-only as it is, and a
 * read-write open upgrades it: the commit after the load writes version 2.
 */
static void dd_md_test_journal_upgrade(struct kunit *test)
{
	struct block_device *bdev = dd_test_dev_open(test);
	struct dd_md_config *cfg = dd_test_cfg(test, 1000, 100);
	struct dd_metadata *md = dd_test_md_open(test, bdev, cfg);
	u8 *raw = kunit_kmalloc(test, DD_BLOCK_SIZE, GFP_KERNEL);
	u64 pba0;

	KUNIT_ASSERT_NOT_NULL(test, raw);
	pba0 = dd_test_write(test, md, 0, 10);
	KUNIT_ASSERT_EQ(test, dd_test_commit(test, md), 0);
	dd_test_md_close(test, md);
	dd_test_patch_sb(test, bdev, DD_SB_OFF_VERSION, 1, 4);
	dd_test_patch_sb(test, bdev, DD_SB_OFF_JOURNAL_START, 0, 8);
	dd_test_patch_sb(test, bdev, DD_SB_OFF_JOURNAL_START + 8, 0, 8);
	dd_test_patch_sb(test, bdev, DD_SB_OFF_JOURNAL_SEQ, 0, 8);
	dd_test_patch_sb(test, bdev, DD_SB_OFF_JOURNAL_SEQ + 8, 0, 8);

	cfg->read_only = true;
	md = dd_test_md_open(test, bdev, cfg);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).journal_total, 0);
	dd_test_expect_map(test, md, 0, pba0);
	dd_test_md_close(test, md);
	dd_test_sb_slot(test, bdev, raw);
	KUNIT_EXPECT_EQ(test, get_unaligned_le32(raw + DD_SB_OFF_VERSION), 1);

	cfg->read_only = false;
	md = dd_test_md_open(test, bdev, cfg);
	KUNIT_EXPECT_GE(test, dd_test_stats(md).journal_total,
			DD_JOURNAL_MAKE_MIN);
	dd_test_expect_map(test, md, 0, pba0);
	dd_test_write(test, md, 1, 11);
	dd_test_append(test, md);
	dd_test_md_close(test, md);
	dd_test_sb_slot(test, bdev, raw);
	KUNIT_EXPECT_EQ(test, get_unaligned_le32(raw + DD_SB_OFF_VERSION), 2);
	md = dd_test_md_open(test, bdev, cfg);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).journal_replayed, 1);
	KUNIT_EXPECT_EQ(test, dd_test_stats(md).mapped, 2);
}

static struct kunit_case dd_md_cases[] = {
	KUNIT_CASE(dd_md_test_format),
	KUNIT_CASE(dd_md_test_open_refused),
	KUNIT_CASE(dd_md_test_identity),
	KUNIT_CASE(dd_md_test_map_reopen),
	KUNIT_CASE(dd_md_test_free_after_commit),
	KUNIT_CASE(dd_md_test_rewrite_same),
	KUNIT_CASE(dd_md_test_metadata_blocks),
	KUNIT_CASE(dd_md_test_abort),
	KUNIT_CASE(dd_md_test_refcount_max),
	KUNIT_CASE(dd_md_test_refcount_errors),
	KUNIT_CASE(dd_md_test_duplicate_dead),
	KUNIT_CASE(dd_md_test_first_holders),
	KUNIT_CASE(dd_md_test_alloc_data),
	KUNIT_CASE(dd_md_test_runs),
	KUNIT_CASE(dd_md_test_reserve),
	KUNIT_CASE(dd_md_test_promise),
	KUNIT_CASE(dd_md_test_map_new_run),
	KUNIT_CASE(dd_md_test_unmap_range),
	KUNIT_CASE(dd_md_test_unmap_max_freed),
	KUNIT_CASE(dd_md_test_tall_map),
	KUNIT_CASE(dd_md_test_grow),
	KUNIT_CASE(dd_md_test_needs_check),
	KUNIT_CASE(dd_md_test_short_fingerprint),
	KUNIT_CASE(dd_md_test_zero_fingerprint),
	KUNIT_CASE(dd_md_test_superblock_fallback),
	KUNIT_CASE(dd_md_test_journal_epochs),
	KUNIT_CASE(dd_md_test_journal_shared_epochs),
	KUNIT_CASE(dd_md_test_txn_limit),
	KUNIT_CASE(dd_md_test_damaged_tree),
	KUNIT_CASE(dd_md_test_map_beyond_data),
	KUNIT_CASE(dd_md_test_saved),
	KUNIT_CASE(dd_md_test_saved_refused),
	KUNIT_CASE(dd_md_test_journal_replay),
	KUNIT_CASE(dd_md_test_in_place),
	KUNIT_CASE(dd_md_test_share_runs),
	KUNIT_CASE(dd_md_test_share_only),
	KUNIT_CASE(dd_md_test_new_in_place),
	KUNIT_CASE(dd_md_test_journal_counts_only),
	KUNIT_CASE(dd_md_test_journal_torn),
	KUNIT_CASE(dd_md_test_journal_unflushed),
	KUNIT_CASE(dd_md_test_journal_upgrade),
	KUNIT_CASE_SLOW(dd_md_test_journal_wrap),
	KUNIT_CASE(dd_md_test_journal_many_blocks),
	KUNIT_CASE_SLOW(dd_md_test_commit_churn),
	{}
};

static struct kunit_suite dd_md_suite = {
	.name = "dm_dedup_metadata",
	.test_cases = dd_md_cases,
};

kunit_test_suite(dd_md_suite);
