// SPDX-License-Identifier: GPL-2.0-only
/*
 * KUnit tests of the persistent copy-on-write arrays (dedup-array.c) that
 * hold the map, the refcounts and the fingerprints, on a ram disk.
 */
#include <kunit/test.h>

#include "dedup-array.h"
#include "dedup-test-util.h"

/* A recognisable entry for @index, never all zeros. */
static void dd_test_entry(u8 *e, u32 size, u64 index)
{
	u32 k;

	for (k = 0; k < size; k++)
		e[k] = (u8)(index >> (8 * (k % 8))) ^ (u8)(k * 29 + 1);
	e[0] |= 0x80;
}

static void dd_test_set(struct kunit *test, struct dd_array *a, u64 index)
{
	struct dd_block leaf;
	void *e;

	KUNIT_ASSERT_EQ_MSG(test, dd_array_update(a, index, &leaf, &e), 0,
			    "index %llu", index);
	dd_test_entry(e, a->entry_size, index);
	dd_bm_release_dirty(&leaf);
}

static void dd_test_expect(struct kunit *test, struct dd_array *a, u64 index,
			   bool set)
{
	u8 want[DD_FP_SIZE] = {}, got[DD_FP_SIZE];

	if (set)
		dd_test_entry(want, a->entry_size, index);
	memset(got, 0x55, sizeof(got));
	KUNIT_ASSERT_EQ(test, dd_array_lookup(a, index, got, false), 0);
	KUNIT_EXPECT_MEMEQ_MSG(test, got, want, a->entry_size,
			       "index %llu", index);
}

struct dd_test_shape {
	u32 entry_size;
	u64 nr_entries;
	u32 per_leaf;
	u8 height;
	u64 max_blocks;
};

/*
 * Heights by the formula of Documentation/dedup-format.rst, at the points
 * where they change, and its two worked examples (65536 and 2^28 map
 * entries).
 */
static void dd_array_test_shape(struct kunit *test)
{
	static const struct dd_test_shape shapes[] = {
		{ 8, 0, 508, 0, 0 },
		{ 8, 1, 508, 0, 1 },
		{ 8, 508, 508, 0, 1 },
		{ 8, 509, 508, 1, 3 },
		{ 8, 508 * 508, 508, 1, 509 },
		{ 8, 508 * 508 + 1, 508, 2, 509 + 2 + 1 },
		{ 8, 65536, 508, 1, 131 },
		{ 8, 268435456, 508, 3, 528417 + 1041 + 3 + 1 },
		{ 4, 1016, 1016, 0, 1 },
		{ 4, 1017, 1016, 1, 3 },
		{ 32, 127, 127, 0, 1 },
		{ 32, 128, 127, 1, 3 },
		{ 8, 1ULL << 40, 508, 4, 2168661992ULL },
	};
	struct dd_array a;
	unsigned int i;

	for (i = 0; i < ARRAY_SIZE(shapes); i++) {
		const struct dd_test_shape *s = &shapes[i];

		dd_array_init(&a, NULL, DD_ARRAY_MAP, s->entry_size,
			      s->nr_entries, 0);
		KUNIT_EXPECT_EQ_MSG(test, a.per_leaf, s->per_leaf, "shape %u",
				    i);
		KUNIT_EXPECT_EQ_MSG(test, a.height, s->height, "shape %u", i);
		KUNIT_EXPECT_EQ_MSG(test, dd_array_max_blocks(s->entry_size,
							      s->nr_entries),
				    s->max_blocks, "shape %u", i);
	}
}

struct dd_test_array_param {
	const char *name;
	u8 id;
	u32 entry_size;
	u64 nr_entries;
};

static const struct dd_test_array_param dd_array_params[] = {
	{ "refcount, one leaf", DD_ARRAY_REFCOUNT, 4, 1016 },
	{ "refcount, height 1", DD_ARRAY_REFCOUNT, 4, 1016 * 3 + 5 },
	{ "fingerprint, height 1", DD_ARRAY_FINGERPRINT, 32, 1000 },
	{ "map, height 2", DD_ARRAY_MAP, 8, 508 * 508 + 1 },
	{ "map, height 4", DD_ARRAY_MAP, 8, 1ULL << 40 },
};

KUNIT_ARRAY_PARAM_DESC(dd_array, dd_array_params, name);

/*
 * Entries at both ends of the array and of the first leaf read back,
 * their neighbours read as zeros, before and after a commit, and a
 * fresh cache reads the same from the device.
 */
static void dd_array_test_set_get(struct kunit *test)
{
	const struct dd_test_array_param *p = test->param_value;
	struct block_device *bdev = dd_test_dev_open(test);
	struct dd_bm *bm = dd_test_bm_create(test, bdev, DD_TEST_DEV_BLOCKS);
	u64 last = p->nr_entries - 1, set[5], unset[4], u;
	u8 buf[DD_FP_SIZE];
	struct dd_array a;
	struct dd_block leaf;
	unsigned int i, round;
	void *e;
	u64 root;

	bm->txn = 1;
	dd_array_init(&a, bm, p->id, p->entry_size, p->nr_entries, 0);
	/* an array of a single leaf has no second leaf to set */
	set[0] = 0;
	set[1] = a.per_leaf - 1;
	set[2] = min_t(u64, a.per_leaf, last);
	set[3] = p->nr_entries / 2;
	set[4] = last;
	unset[0] = 1;
	unset[1] = a.per_leaf + 1;
	unset[2] = p->nr_entries / 2 + 1;
	unset[3] = last - 1;

	/* an empty array reads as zeros everywhere */
	dd_test_expect(test, &a, 0, false);
	dd_test_expect(test, &a, last, false);
	for (i = 0; i < ARRAY_SIZE(set); i++)
		dd_test_set(test, &a, set[i]);
	root = a.root;
	for (round = 0; round < 3; round++) {
		for (i = 0; i < ARRAY_SIZE(set); i++)
			dd_test_expect(test, &a, set[i], true);
		for (i = 0; i < ARRAY_SIZE(unset); i++) {
			u = unset[i];
			if (u < last && u != set[1] && u != set[3])
				dd_test_expect(test, &a, u, false);
		}
		if (round == 0) {
			dd_test_bm_commit(test, bm);
		} else if (round == 1) {
			dd_test_bm_destroy(test, bm);
			bm = dd_test_bm_create(test, bdev, DD_TEST_DEV_BLOCKS);
			bm->txn = 2;
			dd_array_init(&a, bm, p->id, p->entry_size,
				      p->nr_entries, root);
		}
	}

	KUNIT_EXPECT_EQ(test, dd_array_lookup(&a, p->nr_entries, buf, false),
			-ERANGE);
	KUNIT_EXPECT_EQ(test, dd_array_lookup(&a, U64_MAX, buf, false),
			-ERANGE);
	KUNIT_EXPECT_EQ(test, dd_array_update(&a, p->nr_entries, &leaf, &e),
			-ERANGE);
	KUNIT_EXPECT_EQ(test, a.root, root);
}

/* Two paths through a height-4 tree share only the root. */
static void dd_array_test_tall_edges(struct kunit *test)
{
	struct block_device *bdev = dd_test_dev_open(test);
	struct dd_bm *bm = dd_test_bm_create(test, bdev, DD_TEST_DEV_BLOCKS);
	const u64 nr = 1ULL << 40;
	struct dd_array a;

	bm->txn = 1;
	dd_array_init(&a, bm, DD_ARRAY_MAP, 8, nr, 0);
	KUNIT_ASSERT_EQ(test, a.height, 4);
	dd_test_set(test, &a, 0);
	KUNIT_EXPECT_EQ(test, bm->space.nr_used, DD_FIRST_TREE_BLOCK + 5);
	dd_test_set(test, &a, nr - 1);
	KUNIT_EXPECT_EQ(test, bm->space.nr_used, DD_FIRST_TREE_BLOCK + 9);
	dd_test_expect(test, &a, 0, true);
	dd_test_expect(test, &a, nr - 1, true);
	dd_test_expect(test, &a, nr - 2, false);
	dd_test_expect(test, &a, 508ULL * 508 * 508 * 508, false);
}

/*
 * After a commit, changes go to copies: the committed tree, reached from
 * the old root, keeps every old value, in the cache and on the device.
 */
static void dd_array_test_shadow_after_commit(struct kunit *test)
{
	struct block_device *bdev = dd_test_dev_open(test);
	struct dd_bm *bm = dd_test_bm_create(test, bdev, DD_TEST_DEV_BLOCKS);
	struct dd_array a, old;
	struct dd_block leaf;
	u64 root1, used1, root2;
	__le64 *e, v;

	bm->txn = 1;
	dd_array_init(&a, bm, DD_ARRAY_MAP, 8, 2000, 0);
	KUNIT_ASSERT_EQ(test, a.height, 1);
	dd_test_set(test, &a, 0);
	dd_test_set(test, &a, 1500);
	dd_test_bm_commit(test, bm);
	root1 = a.root;
	used1 = bm->space.nr_used;

	KUNIT_ASSERT_EQ(test, dd_array_update(&a, 0, &leaf, (void **)&e), 0);
	*e = cpu_to_le64(111);
	dd_bm_release_dirty(&leaf);
	root2 = a.root;
	KUNIT_EXPECT_NE(test, root2, root1);
	/* new root and new leaf; the old ones wait for the commit */
	KUNIT_EXPECT_EQ(test, bm->space.nr_used, used1 + 2);
	KUNIT_EXPECT_EQ(test, bm->space.nr_pending, 2);

	dd_array_init(&old, bm, DD_ARRAY_MAP, 8, 2000, root1);
	dd_test_expect(test, &old, 0, true);
	dd_test_expect(test, &old, 1500, true);
	KUNIT_ASSERT_EQ(test, dd_array_lookup(&a, 0, &v, false), 0);
	KUNIT_EXPECT_EQ(test, le64_to_cpu(v), 111);
	dd_test_expect(test, &a, 1500, true);

	/* the running transaction's own blocks change in place */
	KUNIT_ASSERT_EQ(test, dd_array_update(&a, 1, &leaf, (void **)&e), 0);
	*e = cpu_to_le64(222);
	dd_bm_release_dirty(&leaf);
	KUNIT_EXPECT_EQ(test, a.root, root2);
	KUNIT_EXPECT_EQ(test, bm->space.nr_used, used1 + 2);
	dd_test_set(test, &a, 1501);
	KUNIT_EXPECT_EQ(test, a.root, root2);
	KUNIT_EXPECT_EQ(test, bm->space.nr_used, used1 + 3);
	KUNIT_EXPECT_EQ(test, bm->space.nr_pending, 3);

	/* the device, read through a fresh cache, agrees */
	KUNIT_ASSERT_EQ(test, dd_bm_write_all(bm), 0);
	dd_test_bm_destroy(test, bm);
	bm = dd_test_bm_create(test, bdev, DD_TEST_DEV_BLOCKS);
	bm->txn = 3;
	dd_array_init(&old, bm, DD_ARRAY_MAP, 8, 2000, root1);
	dd_test_expect(test, &old, 0, true);
	dd_test_expect(test, &old, 1, false);
	dd_test_expect(test, &old, 1501, false);
	dd_array_init(&a, bm, DD_ARRAY_MAP, 8, 2000, root2);
	KUNIT_ASSERT_EQ(test, dd_array_lookup(&a, 1, &v, false), 0);
	KUNIT_EXPECT_EQ(test, le64_to_cpu(v), 222);
	dd_test_expect(test, &a, 1501, true);
}

struct dd_test_walk {
	unsigned int n;
	u64 first[8];
	u32 count[8];
};

static int dd_test_walk_fn(void *ctx, u64 first_index, const void *entries,
			   u32 count)
{
	struct dd_test_walk *w = ctx;

	if (w->n < ARRAY_SIZE(w->first)) {
		w->first[w->n] = first_index;
		w->count[w->n] = count;
	}
	w->n++;
	return 0;
}

/* A committed fingerprint array of 1000 entries, leaves 0, 1 and 7. */
static u64 dd_test_fp_array(struct kunit *test, struct block_device *bdev)
{
	struct dd_bm *bm = dd_test_bm_create(test, bdev, DD_TEST_DEV_BLOCKS);
	struct dd_array a;

	bm->txn = 1;
	dd_array_init(&a, bm, DD_ARRAY_FINGERPRINT, 32, 1000, 0);
	dd_test_set(test, &a, 0);
	dd_test_set(test, &a, 126);
	dd_test_set(test, &a, 127);
	dd_test_set(test, &a, 999);
	dd_test_bm_commit(test, bm);
	dd_test_bm_destroy(test, bm);
	return a.root;
}

/*
 * Activation's walk: every present leaf once, the last one cut at the
 * array's end, every block marked in use; a block met twice, or one not
 * older than the running transaction, is corruption.
 */
static void dd_array_test_walk(struct kunit *test)
{
	struct block_device *bdev = dd_test_dev_open(test);
	u64 root = dd_test_fp_array(test, bdev);
	struct dd_test_walk w = {};
	struct dd_array a;
	struct dd_bm *bm;

	bm = dd_test_bm_create(test, bdev, DD_TEST_DEV_BLOCKS);
	bm->txn = 2;
	dd_array_init(&a, bm, DD_ARRAY_FINGERPRINT, 32, 1000, root);
	KUNIT_ASSERT_EQ(test, dd_array_walk(&a, dd_test_walk_fn, &w), 0);
	KUNIT_ASSERT_EQ(test, w.n, 3);
	KUNIT_EXPECT_EQ(test, w.first[0], 0);
	KUNIT_EXPECT_EQ(test, w.count[0], 127);
	KUNIT_EXPECT_EQ(test, w.first[1], 127);
	KUNIT_EXPECT_EQ(test, w.count[1], 127);
	KUNIT_EXPECT_EQ(test, w.first[2], 7 * 127);
	KUNIT_EXPECT_EQ(test, w.count[2], 1000 - 7 * 127);
	/* the root and three leaves */
	KUNIT_EXPECT_EQ(test, bm->space.nr_used, DD_FIRST_TREE_BLOCK + 4);
	KUNIT_EXPECT_TRUE(test, dd_space_is_used(&bm->space, root));
	KUNIT_EXPECT_EQ(test, dd_array_walk(&a, NULL, NULL), -EILSEQ);
	dd_test_bm_destroy(test, bm);

	bm = dd_test_bm_create(test, bdev, DD_TEST_DEV_BLOCKS);
	bm->txn = 1;
	dd_array_init(&a, bm, DD_ARRAY_FINGERPRINT, 32, 1000, root);
	KUNIT_EXPECT_EQ(test, dd_array_walk(&a, NULL, NULL), -EILSEQ);
	dd_test_bm_destroy(test, bm);

	/* an empty array has nothing to walk */
	bm = dd_test_bm_create(test, bdev, DD_TEST_DEV_BLOCKS);
	bm->txn = 2;
	dd_array_init(&a, bm, DD_ARRAY_FINGERPRINT, 32, 1000, 0);
	KUNIT_EXPECT_EQ(test, dd_array_walk(&a, dd_test_walk_fn, &w), 0);
	KUNIT_EXPECT_EQ(test, bm->space.nr_used, DD_FIRST_TREE_BLOCK);
}

/*
 * Without a leaf callback (the map at activation) leaves are only
 * counted, not read: damage there shows up at lookup instead.
 */
static void dd_array_test_walk_damage(struct kunit *test)
{
	struct block_device *bdev = dd_test_dev_open(test);
	u64 root = dd_test_fp_array(test, bdev), leaf1, used;
	struct dd_test_walk w = {};
	u8 *raw = kunit_kmalloc(test, DD_BLOCK_SIZE, GFP_KERNEL);
	u8 fp[DD_FP_SIZE];
	struct dd_array a;
	struct dd_bm *bm;

	KUNIT_ASSERT_NOT_NULL(test, raw);
	dd_test_read_block(test, bdev, root, raw);
	leaf1 = get_unaligned_le64(raw + DD_HEADER_SIZE + 8);
	KUNIT_ASSERT_NE(test, leaf1, 0);
	dd_test_flip_bit(test, bdev, leaf1, 2000, 0);

	bm = dd_test_bm_create(test, bdev, DD_TEST_DEV_BLOCKS);
	bm->txn = 2;
	dd_array_init(&a, bm, DD_ARRAY_FINGERPRINT, 32, 1000, root);
	KUNIT_EXPECT_EQ(test, dd_array_walk(&a, NULL, NULL), 0);
	used = bm->space.nr_used;
	KUNIT_EXPECT_EQ(test, used, DD_FIRST_TREE_BLOCK + 4);
	KUNIT_EXPECT_EQ(test, dd_array_lookup(&a, 127, fp, false), -EILSEQ);
	dd_test_expect(test, &a, 126, true);
	dd_test_bm_destroy(test, bm);

	bm = dd_test_bm_create(test, bdev, DD_TEST_DEV_BLOCKS);
	bm->txn = 2;
	dd_array_init(&a, bm, DD_ARRAY_FINGERPRINT, 32, 1000, root);
	KUNIT_EXPECT_EQ(test, dd_array_walk(&a, dd_test_walk_fn, &w), -EILSEQ);
	dd_test_bm_destroy(test, bm);

	/*
	 * A child pointer past the last leaf (invariant 10), with a valid
	 * checksum: root slot 8 would hold leaf 8, entries 1016 and up.
	 */
	dd_test_read_block(test, bdev, root, raw);
	put_unaligned_le64(leaf1, raw + DD_HEADER_SIZE + 8 * 8);
	put_unaligned_le64(0, raw + DD_HEADER_SIZE + 8);
	put_unaligned_le32(dd_block_csum(raw), raw);
	dd_test_write_block(test, bdev, root, raw);
	bm = dd_test_bm_create(test, bdev, DD_TEST_DEV_BLOCKS);
	bm->txn = 2;
	dd_array_init(&a, bm, DD_ARRAY_FINGERPRINT, 32, 1000, root);
	KUNIT_EXPECT_EQ(test, dd_array_walk(&a, NULL, NULL), -EILSEQ);
}

/* Absent subtrees are skipped whole, and the end bound is honoured. */
static void dd_array_test_next_leaf(struct kunit *test)
{
	struct block_device *bdev = dd_test_dev_open(test);
	struct dd_bm *bm = dd_test_bm_create(test, bdev, DD_TEST_DEV_BLOCKS);
	const u64 leaves = 1524;
	struct dd_array a, small;
	u64 l;

	bm->txn = 1;
	dd_array_init(&a, bm, DD_ARRAY_MAP, 8, leaves * 508, 0);
	KUNIT_ASSERT_EQ(test, a.height, 2);
	l = 0;
	KUNIT_EXPECT_EQ(test, dd_array_next_leaf(&a, &l, leaves), -ENODATA);

	dd_test_set(test, &a, 0);
	dd_test_set(test, &a, 600 * 508 + 3);
	dd_test_set(test, &a, leaves * 508 - 1);

	l = 0;
	KUNIT_EXPECT_EQ(test, dd_array_next_leaf(&a, &l, leaves), 0);
	KUNIT_EXPECT_EQ(test, l, 0);
	l = 1;
	KUNIT_EXPECT_EQ(test, dd_array_next_leaf(&a, &l, leaves), 0);
	KUNIT_EXPECT_EQ(test, l, 600);
	l = 600;
	KUNIT_EXPECT_EQ(test, dd_array_next_leaf(&a, &l, leaves), 0);
	KUNIT_EXPECT_EQ(test, l, 600);
	l = 601;
	KUNIT_EXPECT_EQ(test, dd_array_next_leaf(&a, &l, leaves), 0);
	KUNIT_EXPECT_EQ(test, l, leaves - 1);
	l = 1;
	KUNIT_EXPECT_EQ(test, dd_array_next_leaf(&a, &l, 600), -ENODATA);
	l = 1;
	KUNIT_EXPECT_EQ(test, dd_array_next_leaf(&a, &l, 601), 0);
	KUNIT_EXPECT_EQ(test, l, 600);
	l = 601;
	KUNIT_EXPECT_EQ(test, dd_array_next_leaf(&a, &l, leaves - 1),
			-ENODATA);
	l = leaves;
	KUNIT_EXPECT_EQ(test, dd_array_next_leaf(&a, &l, leaves), -ENODATA);

	/* height 0: the root is leaf 0 */
	dd_array_init(&small, bm, DD_ARRAY_MAP, 8, 100, 0);
	dd_test_set(test, &small, 99);
	l = 0;
	KUNIT_EXPECT_EQ(test, dd_array_next_leaf(&small, &l, 1), 0);
	KUNIT_EXPECT_EQ(test, l, 0);
	l = 1;
	KUNIT_EXPECT_EQ(test, dd_array_next_leaf(&small, &l, 2), -ENODATA);
}

static void dd_array_test_read_leaf(struct kunit *test)
{
	struct block_device *bdev = dd_test_dev_open(test);
	struct dd_bm *bm = dd_test_bm_create(test, bdev, DD_TEST_DEV_BLOCKS);
	__le32 *entries = kunit_kmalloc(test, DD_PAYLOAD_SIZE, GFP_KERNEL);
	u8 want[4];
	struct dd_array a;
	u32 i;

	KUNIT_ASSERT_NOT_NULL(test, entries);
	bm->txn = 1;
	dd_array_init(&a, bm, DD_ARRAY_REFCOUNT, 4, 5000, 0);
	dd_test_set(test, &a, 1016 + 7);
	memset(entries, 0xff, DD_PAYLOAD_SIZE);
	KUNIT_ASSERT_EQ(test, dd_array_read_leaf(&a, 0, entries), 0);
	KUNIT_EXPECT_NULL(test, memchr_inv(entries, 0, DD_PAYLOAD_SIZE));
	KUNIT_ASSERT_EQ(test, dd_array_read_leaf(&a, 1, entries), 0);
	dd_test_entry(want, 4, 1016 + 7);
	for (i = 0; i < 1016; i++) {
		if (i == 7)
			KUNIT_EXPECT_MEMEQ(test, &entries[i], want, 4);
		else
			KUNIT_EXPECT_EQ_MSG(test, le32_to_cpu(entries[i]), 0,
					    "entry %u", i);
	}
}

/*
 * Growing keeps every entry where it was, through new roots whose child 0
 * is the old tree, and the tree reaches the new end; an empty array only
 * changes its shape.
 */
static void dd_array_test_grow(struct kunit *test)
{
	struct block_device *bdev = dd_test_dev_open(test);
	struct dd_bm *bm = dd_test_bm_create(test, bdev, DD_TEST_DEV_BLOCKS);
	const u64 big = 508ULL * 508 * 508 + 1;
	void *buf = kunit_kmalloc(test, DD_PAYLOAD_SIZE, GFP_KERNEL);
	struct dd_array a, empty, cut;
	u64 root0, used;

	KUNIT_ASSERT_NOT_NULL(test, buf);
	bm->txn = 1;
	dd_array_init(&a, bm, DD_ARRAY_MAP, 8, 100, 0);
	dd_test_set(test, &a, 0);
	dd_test_set(test, &a, 99);
	dd_test_bm_commit(test, bm);
	root0 = a.root;
	used = bm->space.nr_used;

	KUNIT_EXPECT_EQ(test, dd_array_grow(&a, 99, buf), -EINVAL);
	KUNIT_ASSERT_EQ(test, dd_array_grow(&a, 508, buf), 0);
	KUNIT_EXPECT_EQ(test, a.height, 0);
	KUNIT_EXPECT_EQ(test, a.root, root0);
	KUNIT_ASSERT_EQ(test, dd_array_grow(&a, big, buf), 0);
	KUNIT_EXPECT_EQ(test, a.height, 3);
	KUNIT_EXPECT_EQ(test, a.nr_entries, big);
	/* three new roots; the committed leaf is not copied */
	KUNIT_EXPECT_EQ(test, bm->space.nr_used, used + 3);
	dd_test_expect(test, &a, 0, true);
	dd_test_expect(test, &a, 99, true);
	dd_test_expect(test, &a, 100, false);
	dd_test_expect(test, &a, big - 1, false);
	dd_test_set(test, &a, big - 1);
	dd_test_set(test, &a, 508);
	dd_test_expect(test, &a, big - 1, true);
	dd_test_expect(test, &a, 508, true);
	dd_test_expect(test, &a, 99, true);

	dd_array_init(&empty, bm, DD_ARRAY_REFCOUNT, 4, 10, 0);
	KUNIT_ASSERT_EQ(test, dd_array_grow(&empty, 5000, buf), 0);
	KUNIT_EXPECT_EQ(test, empty.root, 0);
	KUNIT_EXPECT_EQ(test, empty.height, 1);
	dd_test_set(test, &empty, 4999);
	dd_test_expect(test, &empty, 4999, true);

	/* as the next activation sees it: a well-formed tree of the new size */
	dd_test_bm_commit(test, bm);
	root0 = a.root;
	dd_test_bm_destroy(test, bm);
	bm = dd_test_bm_create(test, bdev, DD_TEST_DEV_BLOCKS);
	bm->txn = 3;
	dd_array_init(&a, bm, DD_ARRAY_MAP, 8, big, root0);
	KUNIT_EXPECT_EQ(test, dd_array_walk(&a, NULL, NULL), 0);
	KUNIT_EXPECT_EQ(test, bm->space.nr_used, DD_FIRST_TREE_BLOCK + 3 + 1 + 4);
	dd_test_expect(test, &a, 0, true);
	dd_test_expect(test, &a, 508, true);
	dd_test_expect(test, &a, big - 1, true);

	/* damage past the old end would become live: refused */
	dd_array_init(&cut, bm, DD_ARRAY_MAP, 8, 60, 0);
	dd_test_set(test, &cut, 59);
	cut.nr_entries = 50;
	KUNIT_EXPECT_EQ(test, dd_array_grow(&cut, 1000, buf), -EILSEQ);
	KUNIT_EXPECT_EQ(test, cut.nr_entries, 50);
}

/* A lookup that must not sleep fails instead of reading the device. */
static void dd_array_test_lookup_nowait(struct kunit *test)
{
	struct block_device *bdev = dd_test_dev_open(test);
	u64 root = dd_test_fp_array(test, bdev);
	struct dd_bm *bm = dd_test_bm_create(test, bdev, DD_TEST_DEV_BLOCKS);
	u8 got[DD_FP_SIZE], want[DD_FP_SIZE];
	struct dd_array a;

	bm->txn = 2;
	dd_array_init(&a, bm, DD_ARRAY_FINGERPRINT, 32, 1000, root);
	KUNIT_EXPECT_EQ(test, dd_array_lookup(&a, 999, got, true),
			-EWOULDBLOCK);
	dd_test_expect(test, &a, 999, true);
	KUNIT_ASSERT_EQ(test, dd_array_lookup(&a, 999, got, true), 0);
	dd_test_entry(want, 32, 999);
	KUNIT_EXPECT_MEMEQ(test, got, want, 32);
	/* an absent leaf needs no I/O once the root is cached */
	KUNIT_EXPECT_EQ(test, dd_array_lookup(&a, 500, got, true), 0);
	/* a present leaf that is not cached yet */
	KUNIT_EXPECT_EQ(test, dd_array_lookup(&a, 127, got, true),
			-EWOULDBLOCK);
}

static struct kunit_case dd_array_cases[] = {
	KUNIT_CASE(dd_array_test_shape),
	KUNIT_CASE_PARAM(dd_array_test_set_get, dd_array_gen_params),
	KUNIT_CASE(dd_array_test_tall_edges),
	KUNIT_CASE(dd_array_test_shadow_after_commit),
	KUNIT_CASE(dd_array_test_walk),
	KUNIT_CASE(dd_array_test_walk_damage),
	KUNIT_CASE(dd_array_test_next_leaf),
	KUNIT_CASE(dd_array_test_read_leaf),
	KUNIT_CASE(dd_array_test_lookup_nowait),
	KUNIT_CASE(dd_array_test_grow),
	{}
};

static struct kunit_suite dd_array_suite = {
	.name = "dm_dedup_array",
	.test_cases = dd_array_cases,
};

kunit_test_suite(dd_array_suite);
