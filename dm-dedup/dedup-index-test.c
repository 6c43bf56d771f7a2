// SPDX-License-Identifier: GPL-2.0-only
/*
 * KUnit tests of the RAM fingerprint index (dedup-index.c).
 *
 * The index places a fingerprint in bucket
 * (siphash(fp, key) * nr_buckets) >> 64, with a key drawn at every
 * dd_index_init, and keeps the low (entry_bits - leaf_bits) bits of the
 * same hash as its tag. The collision tests pick fingerprints by these
 * two values, so they really collide; dd_index_test_home_bucket checks
 * the assumption, so that a changed scheme fails here rather than
 * turning the collision tests into no-ops. The index names fingerprint
 * leaves (DD_FP_PER_LEAF blocks each), so "found" means the block's leaf.
 */
#include <kunit/resource.h>
#include <kunit/test.h>
#include <linux/math64.h>
#include <linux/sort.h>
#include <linux/siphash.h>
#include <linux/vmalloc.h>

#include "dedup-index.h"
#include "dedup-test-util.h"

static u64 dd_test_home(const struct dd_index *idx, const u8 *fp)
{
	return mul_u64_u64_shr(siphash(fp, DD_FP_SIZE, &idx->key),
			       idx->nr_buckets, 64);
}

static u64 dd_test_tag(const struct dd_index *idx, const u8 *fp)
{
	return siphash(fp, DD_FP_SIZE, &idx->key) &
	       GENMASK_ULL(idx->entry_bits - idx->leaf_bits - 1, 0);
}

KUNIT_DEFINE_ACTION_WRAPPER(dd_test_index_put, dd_index_exit,
			    struct dd_index *);

static struct dd_index *dd_test_index(struct kunit *test, u64 max_entries)
{
	struct dd_index *idx = kunit_kzalloc(test, sizeof(*idx), GFP_KERNEL);

	KUNIT_ASSERT_NOT_NULL(test, idx);
	KUNIT_ASSERT_EQ(test, dd_index_init(idx, max_entries), 0);
	KUNIT_ASSERT_EQ(test,
			kunit_add_action_or_reset(test, dd_test_index_put, idx),
			0);
	return idx;
}

/* Whether @pba's leaf is among the candidates the index offers for @fp. */
static bool dd_test_has(const struct dd_index *idx, const u8 *fp, u64 pba)
{
	struct dd_index_iter it;
	u64 leaf;

	dd_index_iter_init(idx, fp, &it);
	while (dd_index_iter_next(idx, &it, &leaf))
		if (leaf == dd_index_leaf_of(pba))
			return true;
	return false;
}

static unsigned int dd_test_candidates(const struct dd_index *idx,
				       const u8 *fp)
{
	struct dd_index_iter it;
	unsigned int n = 0;
	u64 leaf;

	dd_index_iter_init(idx, fp, &it);
	while (dd_index_iter_next(idx, &it, &leaf))
		n++;
	return n;
}

/* The non-empty slots, each decoded: all must be well formed. */
static u64 dd_test_count_slots(struct kunit *test, const struct dd_index *idx)
{
	u64 k, leaf, n = 0;
	int r;

	for (k = 0; k < dd_index_nr_slots(idx); k++) {
		r = dd_index_slot_leaf(idx, k, &leaf);
		KUNIT_ASSERT_GE_MSG(test, r, 0, "slot %llu", k);
		n += r;
	}
	return n;
}

/* Block @i in a leaf of its own. */
static u64 dd_test_pba(u64 i)
{
	return i * DD_FP_PER_LEAF + i % DD_FP_PER_LEAF;
}

/*
 * Seeds of @count fingerprints whose home bucket is @home, with pairwise
 * different tags, searched from @seed upwards.
 */
static u64 *dd_test_same_home(struct kunit *test, const struct dd_index *idx,
			      u64 home, unsigned int count, u64 seed)
{
	u64 *seeds = kunit_kcalloc(test, count, sizeof(*seeds), GFP_KERNEL);
	u64 *tags = kunit_kcalloc(test, count, sizeof(*tags), GFP_KERNEL);
	u8 fp[DD_FP_SIZE];
	unsigned int n = 0, i;

	KUNIT_ASSERT_NOT_NULL(test, seeds);
	KUNIT_ASSERT_NOT_NULL(test, tags);
	for (; n < count; seed++) {
		KUNIT_ASSERT_LT(test, seed, 100000000ULL);
		dd_test_fp(fp, seed);
		if (dd_test_home(idx, fp) != home)
			continue;
		for (i = 0; i < n && tags[i] != dd_test_tag(idx, fp); i++)
			;
		if (i < n)
			continue;
		tags[n] = dd_test_tag(idx, fp);
		seeds[n++] = seed;
	}
	kunit_kfree(test, tags);
	return seeds;
}

static void dd_index_test_insert_find_remove(struct kunit *test)
{
	const u64 nr = 1000;
	struct dd_index *idx = dd_test_index(test, nr * DD_FP_PER_LEAF);
	u8 fp[DD_FP_SIZE];
	u64 i;

	for (i = 0; i < nr; i++) {
		dd_test_fp(fp, i);
		KUNIT_ASSERT_EQ(test, dd_index_insert(idx, fp, dd_test_pba(i)), 0);
	}
	KUNIT_EXPECT_EQ(test, idx->nr_entries, nr);
	KUNIT_EXPECT_EQ(test, dd_test_count_slots(test, idx), nr);
	for (i = 0; i < nr; i++) {
		dd_test_fp(fp, i);
		KUNIT_EXPECT_TRUE_MSG(test, dd_test_has(idx, fp, dd_test_pba(i)),
				      "seed %llu", i);
		/* the right fingerprint in another leaf is no match */
		KUNIT_EXPECT_FALSE(test,
				   dd_test_has(idx, fp, dd_test_pba(i + 1)));
	}
	dd_test_fp(fp, 5000);
	KUNIT_EXPECT_EQ(test, dd_test_candidates(idx, fp), 0);
	KUNIT_EXPECT_FALSE(test, dd_index_remove(idx, fp, 1));

	for (i = 0; i < nr; i++) {
		dd_test_fp(fp, i);
		KUNIT_EXPECT_FALSE(test,
				   dd_index_remove(idx, fp, dd_test_pba(i + 1)));
		KUNIT_EXPECT_TRUE(test, dd_index_remove(idx, fp, dd_test_pba(i)));
		KUNIT_EXPECT_FALSE(test, dd_index_remove(idx, fp, dd_test_pba(i)));
		KUNIT_EXPECT_FALSE(test, dd_test_has(idx, fp, dd_test_pba(i)));
	}
	KUNIT_EXPECT_EQ(test, idx->nr_entries, 0);
	/* a removal leaves no tombstone behind */
	KUNIT_EXPECT_NULL(test, memchr_inv(idx->words, 0, dd_index_bytes(idx)));
}

/* An entry alone goes to its home bucket, and nowhere else. */
static void dd_index_test_home_bucket(struct kunit *test)
{
	struct dd_index *idx = dd_test_index(test, 1000);
	u8 fp[DD_FP_SIZE];
	u64 k, seed, home, leaf;

	for (seed = 0; seed < 20; seed++) {
		dd_test_fp(fp, seed);
		home = dd_test_home(idx, fp);
		KUNIT_ASSERT_EQ(test, dd_index_insert(idx, fp, seed), 0);
		for (k = 0; k < dd_index_nr_slots(idx); k++)
			KUNIT_EXPECT_EQ_MSG(test,
					    dd_index_slot_leaf(idx, k, &leaf),
					    k == home * DD_INDEX_BUCKET,
					    "seed %llu slot %llu home %llu",
					    seed, k, home);
		KUNIT_ASSERT_TRUE(test, dd_index_remove(idx, fp, seed));
	}
}

/*
 * Five bucketfuls with one home: they spill into the partner buckets
 * (and push others on), and every one is still found, alone.
 */
static void dd_index_test_same_home(struct kunit *test)
{
	const unsigned int nr = 5 * DD_INDEX_BUCKET;
	struct dd_index *idx = dd_test_index(test, 64 * DD_FP_PER_LEAF);
	u64 home = idx->nr_buckets / 2, *seeds;
	u8 fp[DD_FP_SIZE];
	unsigned int i;

	seeds = dd_test_same_home(test, idx, home, nr, 0);
	for (i = 0; i < nr; i++) {
		dd_test_fp(fp, seeds[i]);
		KUNIT_ASSERT_EQ(test, dd_index_insert(idx, fp, dd_test_pba(i)), 0);
	}
	for (i = 0; i < nr; i++) {
		dd_test_fp(fp, seeds[i]);
		KUNIT_EXPECT_TRUE(test, dd_test_has(idx, fp, dd_test_pba(i)));
		/* tags differ, so nobody else is a candidate */
		KUNIT_EXPECT_EQ(test, dd_test_candidates(idx, fp), 1);
	}
	for (i = 0; i < nr; i += 2) {
		dd_test_fp(fp, seeds[i]);
		KUNIT_EXPECT_TRUE(test, dd_index_remove(idx, fp, dd_test_pba(i)));
	}
	for (i = 0; i < nr; i++) {
		dd_test_fp(fp, seeds[i]);
		KUNIT_EXPECT_EQ_MSG(test, dd_test_has(idx, fp, dd_test_pba(i)),
				    i % 2 == 1, "entry %u", i);
	}
	KUNIT_EXPECT_EQ(test, idx->nr_entries, nr / 2);
}

struct dd_test_key {
	u64 key;
	u64 seed;
};

static int dd_test_key_cmp(const void *a, const void *b)
{
	const struct dd_test_key *x = a, *y = b;

	return x->key < y->key ? -1 : x->key > y->key;
}

/*
 * Two different fingerprints with the same home and the same tag: the
 * index cannot tell them apart and must offer both leaves; the caller's
 * full comparison decides. Found by the birthday paradox under a fixed
 * key (so the pair is the same at every run): 2^18 fingerprints over
 * 17 * 2^28 (home, tag) pairs hold about 7 such pairs.
 */
static void dd_index_test_same_tag(struct kunit *test)
{
	struct dd_index *idx = dd_test_index(test, 2 * DD_FP_PER_LEAF);
	const unsigned int n = 1 << 18;
	struct dd_test_key *keys;
	u8 fp1[DD_FP_SIZE], fp2[DD_FP_SIZE];
	unsigned int i;

	idx->key.key[0] = 0x0123456789abcdefULL;
	idx->key.key[1] = 0xfedcba9876543210ULL;
	keys = kvcalloc(n, sizeof(*keys), GFP_KERNEL);
	KUNIT_ASSERT_NOT_NULL(test, keys);
	for (i = 0; i < n; i++) {
		dd_test_fp(fp1, i);
		keys[i].key = dd_test_home(idx, fp1) << 40 | dd_test_tag(idx, fp1);
		keys[i].seed = i;
	}
	sort(keys, n, sizeof(*keys), dd_test_key_cmp, NULL);
	for (i = 1; i < n && keys[i].key != keys[i - 1].key; i++)
		;
	if (i < n) {
		dd_test_fp(fp1, keys[i - 1].seed);
		dd_test_fp(fp2, keys[i].seed);
	}
	kvfree(keys);
	KUNIT_ASSERT_LT_MSG(test, i, n, "no colliding pair among the seeds");
	KUNIT_ASSERT_NE(test, memcmp(fp1, fp2, DD_FP_SIZE), 0);
	KUNIT_ASSERT_EQ(test, dd_test_home(idx, fp1), dd_test_home(idx, fp2));
	KUNIT_ASSERT_EQ(test, dd_test_tag(idx, fp1), dd_test_tag(idx, fp2));

	KUNIT_ASSERT_EQ(test, dd_index_insert(idx, fp1, 11), 0);
	KUNIT_ASSERT_EQ(test, dd_index_insert(idx, fp2, DD_FP_PER_LEAF + 22), 0);
	KUNIT_EXPECT_TRUE(test, dd_test_has(idx, fp1, 11));
	KUNIT_EXPECT_TRUE(test, dd_test_has(idx, fp1, DD_FP_PER_LEAF + 22));
	KUNIT_EXPECT_TRUE(test, dd_test_has(idx, fp2, 11));
	KUNIT_EXPECT_TRUE(test, dd_test_has(idx, fp2, DD_FP_PER_LEAF + 22));
	KUNIT_EXPECT_EQ(test, dd_test_candidates(idx, fp1), 2);

	KUNIT_EXPECT_TRUE(test, dd_index_remove(idx, fp2, DD_FP_PER_LEAF + 22));
	KUNIT_EXPECT_TRUE(test, dd_test_has(idx, fp1, 11));
	KUNIT_EXPECT_FALSE(test, dd_test_has(idx, fp1, DD_FP_PER_LEAF + 22));
	KUNIT_EXPECT_EQ(test, dd_test_candidates(idx, fp2), 1);
}

/*
 * One fingerprint on several blocks (a saturated refcount, verify): in
 * two leaves, two candidates; twice in one leaf, two equal entries, and
 * removing either leaves the leaf found.
 */
static void dd_index_test_same_fingerprint(struct kunit *test)
{
	struct dd_index *idx = dd_test_index(test, 4 * DD_FP_PER_LEAF);
	u8 fp[DD_FP_SIZE];

	dd_test_fp(fp, 42);
	KUNIT_ASSERT_EQ(test, dd_index_insert(idx, fp, 1), 0);
	KUNIT_ASSERT_EQ(test, dd_index_insert(idx, fp, 2), 0);
	KUNIT_ASSERT_EQ(test, dd_index_insert(idx, fp, DD_FP_PER_LEAF + 3), 0);
	KUNIT_EXPECT_EQ(test, dd_test_candidates(idx, fp), 3);
	KUNIT_EXPECT_TRUE(test, dd_index_remove(idx, fp, 1));
	KUNIT_EXPECT_TRUE(test, dd_test_has(idx, fp, 2));
	KUNIT_EXPECT_TRUE(test, dd_index_remove(idx, fp, 2));
	KUNIT_EXPECT_FALSE(test, dd_test_has(idx, fp, 2));
	KUNIT_EXPECT_TRUE(test, dd_test_has(idx, fp, DD_FP_PER_LEAF + 3));
	KUNIT_EXPECT_EQ(test, idx->nr_entries, 1);
}

/* At max_entries the index refuses more, and a refusal changes nothing. */
static void dd_index_test_full(struct kunit *test)
{
	const u64 max = 100;
	struct dd_index *idx = dd_test_index(test, max);
	size_t bytes = dd_index_bytes(idx);
	u8 fp[DD_FP_SIZE];
	u64 *before, i;

	for (i = 0; i < max; i++) {
		dd_test_fp(fp, i);
		KUNIT_ASSERT_EQ(test, dd_index_insert(idx, fp, i), 0);
	}
	KUNIT_EXPECT_EQ(test, idx->nr_entries, max);

	before = kunit_kmalloc(test, bytes, GFP_KERNEL);
	KUNIT_ASSERT_NOT_NULL(test, before);
	memcpy(before, idx->words, bytes);
	dd_test_fp(fp, max);
	KUNIT_EXPECT_EQ(test, dd_index_insert(idx, fp, 0), -ENOSPC);
	KUNIT_EXPECT_EQ(test, idx->nr_entries, max);
	KUNIT_EXPECT_MEMEQ(test, idx->words, before, bytes);

	for (i = 0; i < max; i += 2) {
		dd_test_fp(fp, i);
		KUNIT_EXPECT_TRUE(test, dd_index_remove(idx, fp, i));
	}
	for (i = max; i < max + max / 2; i++) {
		dd_test_fp(fp, i);
		KUNIT_EXPECT_EQ(test, dd_index_insert(idx, fp, i - max), 0);
	}
	dd_test_fp(fp, 2 * max);
	KUNIT_EXPECT_EQ(test, dd_index_insert(idx, fp, 1), -ENOSPC);
	/* all in leaf 0: a removed fingerprint has no candidate left */
	for (i = 1; i < max + max / 2; i++) {
		dd_test_fp(fp, i);
		KUNIT_EXPECT_EQ_MSG(test, dd_test_candidates(idx, fp),
				    i >= max || i % 2 == 1, "entry %llu", i);
	}
}

/*
 * Entries of one fingerprint share both buckets: once those are full,
 * the next is refused after a walk that goes nowhere, and the walk is
 * undone entry by entry.
 */
static void dd_index_test_kick_undone(struct kunit *test)
{
	struct dd_index *idx = dd_test_index(test, 64 * DD_FP_PER_LEAF);
	size_t bytes = dd_index_bytes(idx);
	struct dd_index_iter it;
	unsigned int room, i;
	u8 fp[DD_FP_SIZE];
	u64 *before;

	dd_test_fp(fp, 7);
	dd_index_iter_init(idx, fp, &it);
	room = it.bucket[0] == it.bucket[1] ? DD_INDEX_BUCKET :
					      2 * DD_INDEX_BUCKET;
	for (i = 0; i < room; i++)
		KUNIT_ASSERT_EQ_MSG(test,
				    dd_index_insert(idx, fp, dd_test_pba(i)), 0,
				    "entry %u", i);
	before = kunit_kmalloc(test, bytes, GFP_KERNEL);
	KUNIT_ASSERT_NOT_NULL(test, before);
	memcpy(before, idx->words, bytes);
	KUNIT_EXPECT_EQ(test, dd_index_insert(idx, fp, dd_test_pba(room)),
			-ENOSPC);
	KUNIT_EXPECT_MEMEQ(test, idx->words, before, bytes);
	KUNIT_EXPECT_EQ(test, idx->nr_entries, room);
	KUNIT_EXPECT_EQ(test, dd_test_candidates(idx, fp), room);

	KUNIT_EXPECT_TRUE(test, dd_index_remove(idx, fp, dd_test_pba(3)));
	KUNIT_EXPECT_EQ(test, dd_index_insert(idx, fp, dd_test_pba(room)), 0);
	KUNIT_EXPECT_TRUE(test, dd_test_has(idx, fp, dd_test_pba(room)));
	KUNIT_EXPECT_FALSE(test, dd_test_has(idx, fp, dd_test_pba(3)));
}

static void dd_index_test_leaf_range(struct kunit *test)
{
	const u64 max = 3 * DD_FP_PER_LEAF + 5;
	struct dd_index *idx = dd_test_index(test, max);
	u8 fp[DD_FP_SIZE];

	KUNIT_EXPECT_EQ(test, idx->nr_leaves, 4);
	dd_test_fp(fp, 1);
	KUNIT_EXPECT_EQ(test, dd_index_insert(idx, fp, 0), 0);
	KUNIT_EXPECT_TRUE(test, dd_test_has(idx, fp, 0));
	dd_test_fp(fp, 2);
	KUNIT_EXPECT_EQ(test, dd_index_insert(idx, fp, max - 1), 0);
	KUNIT_EXPECT_TRUE(test, dd_test_has(idx, fp, max - 1));
	dd_test_fp(fp, 3);
	/* the last leaf is partial: its unused blocks still name it */
	KUNIT_EXPECT_EQ(test, dd_index_insert(idx, fp,
					      4 * DD_FP_PER_LEAF - 1), 0);
	dd_test_fp(fp, 4);
	KUNIT_EXPECT_EQ(test, dd_index_insert(idx, fp, 4 * DD_FP_PER_LEAF),
			-ERANGE);
	KUNIT_EXPECT_EQ(test, dd_index_insert(idx, fp, U64_MAX), -ERANGE);
	KUNIT_EXPECT_EQ(test, dd_test_candidates(idx, fp), 0);
	KUNIT_EXPECT_EQ(test, idx->nr_entries, 3);
}

static void dd_index_test_no_capacity(struct kunit *test)
{
	struct dd_index *idx = dd_test_index(test, 0);
	u8 fp[DD_FP_SIZE];

	dd_test_fp(fp, 1);
	KUNIT_EXPECT_LT(test, dd_index_insert(idx, fp, 0), 0);
	KUNIT_EXPECT_EQ(test, dd_test_candidates(idx, fp), 0);
	KUNIT_EXPECT_FALSE(test, dd_index_remove(idx, fp, 0));
}

/*
 * Entries straddle word boundaries (30 bits each): a slot written must
 * read back, and its neighbours on both sides keep their values.
 */
static void dd_index_test_packing(struct kunit *test)
{
	struct dd_index *idx = dd_test_index(test, 1 << 12);
	u64 i, leaf, n = 0;
	u8 fp[DD_FP_SIZE];

	KUNIT_ASSERT_EQ(test, 64 % idx->entry_bits == 0, false);
	for (i = 0; i < (1 << 12); i += 3) {
		dd_test_fp(fp, i);
		KUNIT_ASSERT_EQ(test, dd_index_insert(idx, fp, i), 0);
		n++;
	}
	KUNIT_EXPECT_EQ(test, dd_test_count_slots(test, idx), n);
	for (i = 0; i < (1 << 12); i += 3) {
		dd_test_fp(fp, i);
		KUNIT_EXPECT_TRUE_MSG(test, dd_test_has(idx, fp, i), "seed %llu", i);
	}
	for (i = 0; i < dd_index_nr_slots(idx); i++)
		if (dd_index_slot_leaf(idx, i, &leaf) == 1)
			KUNIT_EXPECT_LT(test, leaf, idx->nr_leaves);
}

/*
 * Issue 16's budget: at most 4 bytes per data block, for the bench's
 * data disk and computed for 16 TiB (2^32 blocks), with tags of at least
 * 4 bits there.
 */
static void dd_index_test_memory(struct kunit *test)
{
	const u64 max = 1 << 20;
	struct dd_index *idx = dd_test_index(test, max);
	u64 sizes[] = { 1 << 10, 1 << 20, 1ULL << 28, 1ULL << 32 };
	unsigned int i;

	KUNIT_EXPECT_EQ(test, dd_index_bytes(idx), idx->nr_words * sizeof(u64));
	KUNIT_EXPECT_EQ(test, dd_index_bytes_for(max), dd_index_bytes(idx));
	/* every block fits at the design load ... */
	KUNIT_EXPECT_GE(test, dd_index_nr_slots(idx) * 95, max * 100);
	for (i = 0; i < ARRAY_SIZE(sizes); i++)
		KUNIT_EXPECT_LE_MSG(test, dd_index_bytes_for(sizes[i]),
				    sizes[i] * 4 + 64, "%llu blocks", sizes[i]);
	KUNIT_EXPECT_EQ(test, idx->entry_bits, 30);
}

/*
 * A data device full of unique content: every block gets its entry, at
 * the design load, and every one is found.
 */
static void dd_index_test_every_block(struct kunit *test)
{
	const u64 max = 1 << 16;
	struct dd_index *idx = dd_test_index(test, max);
	u8 fp[DD_FP_SIZE];
	u64 i;

	for (i = 0; i < max; i++) {
		dd_test_fp(fp, i + 1000000);
		KUNIT_ASSERT_EQ_MSG(test, dd_index_insert(idx, fp, i), 0,
				    "block %llu", i);
	}
	KUNIT_EXPECT_EQ(test, idx->nr_entries, max);
	for (i = 0; i < max; i++) {
		dd_test_fp(fp, i + 1000000);
		KUNIT_ASSERT_TRUE_MSG(test, dd_test_has(idx, fp, i),
				      "block %llu", i);
	}
}

/*
 * The tags of a 16 TiB device: 4 bits (w = L + 4). Forced here on a small
 * index (its words have room: entries only shrink). Every block still
 * gets its entry at 100 % of the data blocks, many entries are equal
 * (same tag, same leaf) and removals keep the rest, and a lookup of new
 * content finds about 16 * 0.95 / 16 false candidates.
 */
static void dd_index_test_short_tags(struct kunit *test)
{
	const u64 max = 1 << 16;
	struct dd_index *idx = dd_test_index(test, max);
	u64 i, false_cands = 0;
	u8 fp[DD_FP_SIZE];

	idx->entry_bits = idx->leaf_bits + 4;
	for (i = 0; i < max; i++) {
		dd_test_fp(fp, i);
		KUNIT_ASSERT_EQ_MSG(test, dd_index_insert(idx, fp, i), 0,
				    "block %llu", i);
	}
	for (i = 0; i < max; i++) {
		dd_test_fp(fp, max + i);
		false_cands += dd_test_candidates(idx, fp);
	}
	KUNIT_EXPECT_GT(test, false_cands, max / 2);
	KUNIT_EXPECT_LT(test, false_cands, max * 3 / 2);
	for (i = 0; i < max; i += 2) {
		dd_test_fp(fp, i);
		KUNIT_ASSERT_TRUE(test, dd_index_remove(idx, fp, i));
	}
	for (i = 1; i < max; i += 2) {
		dd_test_fp(fp, i);
		KUNIT_ASSERT_TRUE_MSG(test, dd_test_has(idx, fp, i),
				      "block %llu", i);
	}
	KUNIT_EXPECT_EQ(test, dd_test_count_slots(test, idx), max / 2);
}

/*
 * Random inserts and removals near the design load against a plain list
 * of what should be there; every live entry must still be found. This
 * exercises walks and removals in combinations the hand-made cases above
 * do not reach.
 */
static void dd_index_test_random_model(struct kunit *test)
{
	const unsigned int max = 2000, steps = 8000;
	struct dd_index *idx = dd_test_index(test, max);
	u64 *live = kunit_kcalloc(test, max, sizeof(u64), GFP_KERNEL);
	u64 rnd = 0x2545f4914f6cdd1dULL, next_seed = 0, victim;
	unsigned int n = 0, step, i;
	u8 fp[DD_FP_SIZE];
	int r;

	KUNIT_ASSERT_NOT_NULL(test, live);
	for (step = 0; step < steps; step++) {
		rnd ^= rnd << 13;
		rnd ^= rnd >> 7;
		rnd ^= rnd << 17;
		/* fill up to the limit, then churn around it */
		if (n == 0 || (n < max && rnd % 8 < 5)) {
			dd_test_fp(fp, next_seed);
			r = dd_index_insert(idx, fp, next_seed % max);
			KUNIT_ASSERT_EQ_MSG(test, r, 0, "step %u", step);
			live[n++] = next_seed++;
		} else {
			i = (rnd >> 8) % n;
			victim = live[i];
			live[i] = live[--n];
			dd_test_fp(fp, victim);
			KUNIT_ASSERT_TRUE_MSG(test,
					      dd_index_remove(idx, fp, victim % max),
					      "step %u", step);
		}
		KUNIT_ASSERT_EQ(test, idx->nr_entries, n);
		if (step % 64)
			continue;
		for (i = 0; i < n; i++) {
			dd_test_fp(fp, live[i]);
			KUNIT_ASSERT_TRUE_MSG(test,
					      dd_test_has(idx, fp, live[i] % max),
					      "step %u, entry %llu", step,
					      live[i]);
		}
	}
	KUNIT_EXPECT_EQ(test, dd_test_count_slots(test, idx), n);
}

/*
 * Two activations place the same fingerprints differently: nobody can
 * prepare content that crowds one bucket pair of the next activation.
 */
static void dd_index_test_keyed(struct kunit *test)
{
	struct dd_index *a = dd_test_index(test, 1 << 16);
	struct dd_index *b = dd_test_index(test, 1 << 16);
	unsigned int i, same = 0;
	u8 fp[DD_FP_SIZE];

	KUNIT_EXPECT_MEMNEQ(test, &a->key, &b->key, sizeof(a->key));
	for (i = 0; i < 64; i++) {
		dd_test_fp(fp, i);
		same += dd_test_home(a, fp) == dd_test_home(b, fp);
	}
	/* by chance, 64 / 8624 of them on average */
	KUNIT_EXPECT_LT(test, same, 4);
}

static struct kunit_case dd_index_cases[] = {
	KUNIT_CASE(dd_index_test_insert_find_remove),
	KUNIT_CASE(dd_index_test_home_bucket),
	KUNIT_CASE(dd_index_test_same_home),
	KUNIT_CASE(dd_index_test_same_tag),
	KUNIT_CASE(dd_index_test_same_fingerprint),
	KUNIT_CASE(dd_index_test_full),
	KUNIT_CASE(dd_index_test_kick_undone),
	KUNIT_CASE(dd_index_test_leaf_range),
	KUNIT_CASE(dd_index_test_no_capacity),
	KUNIT_CASE(dd_index_test_packing),
	KUNIT_CASE(dd_index_test_memory),
	KUNIT_CASE(dd_index_test_every_block),
	KUNIT_CASE(dd_index_test_short_tags),
	KUNIT_CASE(dd_index_test_random_model),
	KUNIT_CASE(dd_index_test_keyed),
	{}
};

static struct kunit_suite dd_index_suite = {
	.name = "dm_dedup_index",
	.test_cases = dd_index_cases,
};

kunit_test_suite(dd_index_suite);
