// SPDX-License-Identifier: GPL-2.0-only
/*
 * KUnit tests of the RAM fingerprint index (dedup-index.c).
 *
 * The index places a fingerprint at home slot
 * (siphash(fp, key) * nr_slots) >> 64, with a key drawn at every
 * dd_index_init, and keeps the low 16 bits of the same hash as its tag. The collision
 * tests pick fingerprints by these two values, so they really collide;
 * dd_index_home_slot checks the assumption, so that a changed scheme
 * fails here rather than turning the collision tests into no-ops.
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
	return mul_u64_u64_shr(siphash(fp, DD_FP_SIZE, &idx->key), idx->nr_slots,
			       64);
}

static u16 dd_test_tag(const struct dd_index *idx, const u8 *fp)
{
	return (u16)siphash(fp, DD_FP_SIZE, &idx->key);
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

/* Whether @pba is among the candidates the index offers for @fp. */
static bool dd_test_has(const struct dd_index *idx, const u8 *fp, u64 pba)
{
	struct dd_index_iter it;
	u64 found;

	dd_index_iter_init(idx, fp, &it);
	while (dd_index_iter_next(idx, &it, &found))
		if (found == pba)
			return true;
	return false;
}

static unsigned int dd_test_candidates(const struct dd_index *idx,
				       const u8 *fp)
{
	struct dd_index_iter it;
	unsigned int n = 0;
	u64 found;

	dd_index_iter_init(idx, fp, &it);
	while (dd_index_iter_next(idx, &it, &found))
		n++;
	return n;
}

/*
 * Seeds of @count fingerprints whose home slot is @home, with pairwise
 * different tags, searched from @seed upwards.
 */
static u64 *dd_test_same_home(struct kunit *test, const struct dd_index *idx,
			      u64 home, unsigned int count, u64 seed)
{
	u64 *seeds = kunit_kcalloc(test, count, sizeof(*seeds), GFP_KERNEL);
	unsigned long *tags = kunit_kzalloc(test, BITS_TO_LONGS(1 << 16) *
					    sizeof(long), GFP_KERNEL);
	u8 fp[DD_FP_SIZE];
	unsigned int n = 0;

	KUNIT_ASSERT_NOT_NULL(test, seeds);
	KUNIT_ASSERT_NOT_NULL(test, tags);
	for (; n < count; seed++) {
		KUNIT_ASSERT_LT(test, seed, 100000000ULL);
		dd_test_fp(fp, seed);
		if (dd_test_home(idx, fp) != home ||
		    __test_and_set_bit(dd_test_tag(idx, fp), tags))
			continue;
		seeds[n++] = seed;
	}
	kunit_kfree(test, tags);
	return seeds;
}

static void dd_index_test_insert_find_remove(struct kunit *test)
{
	struct dd_index *idx = dd_test_index(test, 1000);
	u8 fp[DD_FP_SIZE];
	u64 i;

	for (i = 0; i < 1000; i++) {
		dd_test_fp(fp, i);
		KUNIT_ASSERT_EQ(test, dd_index_insert(idx, fp, 3 * i + 1), 0);
	}
	KUNIT_EXPECT_EQ(test, idx->nr_entries, 1000);
	for (i = 0; i < 1000; i++) {
		dd_test_fp(fp, i);
		KUNIT_EXPECT_TRUE_MSG(test, dd_test_has(idx, fp, 3 * i + 1),
				      "seed %llu", i);
		/* the right fingerprint with a wrong block is no match */
		KUNIT_EXPECT_FALSE(test, dd_test_has(idx, fp, 3 * i + 2));
	}
	dd_test_fp(fp, 5000);
	KUNIT_EXPECT_EQ(test, dd_test_candidates(idx, fp), 0);
	KUNIT_EXPECT_FALSE(test, dd_index_remove(idx, fp, 1));

	for (i = 0; i < 1000; i++) {
		dd_test_fp(fp, i);
		KUNIT_EXPECT_FALSE(test, dd_index_remove(idx, fp, 3 * i + 2));
		KUNIT_EXPECT_TRUE(test, dd_index_remove(idx, fp, 3 * i + 1));
		KUNIT_EXPECT_FALSE(test, dd_index_remove(idx, fp, 3 * i + 1));
		KUNIT_EXPECT_FALSE(test, dd_test_has(idx, fp, 3 * i + 1));
	}
	KUNIT_EXPECT_EQ(test, idx->nr_entries, 0);
	/* backward-shift deletion leaves no tombstones behind */
	KUNIT_EXPECT_NULL(test, memchr_inv(idx->slots, 0,
					   dd_index_bytes(idx)));
}

static void dd_index_test_home_slot(struct kunit *test)
{
	struct dd_index *idx = dd_test_index(test, 64);
	u8 fp[DD_FP_SIZE];
	u64 i, seed, home;

	for (seed = 0; seed < 20; seed++) {
		dd_test_fp(fp, seed);
		home = dd_test_home(idx, fp);
		KUNIT_ASSERT_EQ(test, dd_index_insert(idx, fp, seed), 0);
		for (i = 0; i < idx->nr_slots; i++)
			KUNIT_EXPECT_EQ_MSG(test, idx->slots[i] != 0, i == home,
					    "seed %llu slot %llu home %llu",
					    seed, i, home);
		KUNIT_ASSERT_TRUE(test, dd_index_remove(idx, fp, seed));
	}
}

/* Many fingerprints with one home slot: one long probe run. */
static void dd_index_test_same_home(struct kunit *test)
{
	struct dd_index *idx = dd_test_index(test, 64);
	u64 home = idx->nr_slots / 2, *seeds;
	u8 fp[DD_FP_SIZE];
	unsigned int i;

	seeds = dd_test_same_home(test, idx, home, 40, 0);
	for (i = 0; i < 40; i++) {
		dd_test_fp(fp, seeds[i]);
		KUNIT_ASSERT_EQ(test, dd_index_insert(idx, fp, i), 0);
	}
	for (i = 0; i < 40; i++) {
		dd_test_fp(fp, seeds[i]);
		KUNIT_EXPECT_TRUE(test, dd_test_has(idx, fp, i));
		/* tags differ, so nobody else in the run is a candidate */
		KUNIT_EXPECT_EQ(test, dd_test_candidates(idx, fp), 1);
	}
	for (i = 0; i < 40; i += 2) {
		dd_test_fp(fp, seeds[i]);
		KUNIT_EXPECT_TRUE(test, dd_index_remove(idx, fp, i));
	}
	for (i = 0; i < 40; i++) {
		dd_test_fp(fp, seeds[i]);
		KUNIT_EXPECT_EQ_MSG(test, dd_test_has(idx, fp, i), i % 2 == 1,
				    "entry %u", i);
	}
	KUNIT_EXPECT_EQ(test, idx->nr_entries, 20);
}

/* A run that starts in the last slot continues at slot 0. */
static void dd_index_test_wraparound(struct kunit *test)
{
	struct dd_index *idx = dd_test_index(test, 64);
	u64 last = idx->nr_slots - 1, *seeds, *zero_home;
	u8 fp[DD_FP_SIZE];
	unsigned int i;

	seeds = dd_test_same_home(test, idx, last, 10, 0);
	zero_home = dd_test_same_home(test, idx, 0, 1, 0);
	for (i = 0; i < 10; i++) {
		dd_test_fp(fp, seeds[i]);
		KUNIT_ASSERT_EQ(test, dd_index_insert(idx, fp, 100 + i), 0);
	}
	/* slot 0 belongs to it, but must first be taken by the run */
	dd_test_fp(fp, zero_home[0]);
	KUNIT_ASSERT_EQ(test, dd_index_insert(idx, fp, 7), 0);
	KUNIT_EXPECT_NE(test, idx->slots[0], 0);
	KUNIT_EXPECT_NE(test, idx->slots[9], 0);

	for (i = 0; i < 10; i++) {
		dd_test_fp(fp, seeds[i]);
		KUNIT_EXPECT_TRUE(test, dd_test_has(idx, fp, 100 + i));
	}
	dd_test_fp(fp, zero_home[0]);
	KUNIT_EXPECT_TRUE(test, dd_test_has(idx, fp, 7));

	/* the hole in the last slot is filled back across the wrap */
	dd_test_fp(fp, seeds[0]);
	KUNIT_EXPECT_TRUE(test, dd_index_remove(idx, fp, 100));
	KUNIT_EXPECT_NE(test, idx->slots[last], 0);
	for (i = 1; i < 10; i++) {
		dd_test_fp(fp, seeds[i]);
		KUNIT_EXPECT_TRUE(test, dd_test_has(idx, fp, 100 + i));
	}
	dd_test_fp(fp, zero_home[0]);
	KUNIT_EXPECT_TRUE(test, dd_test_has(idx, fp, 7));
	KUNIT_EXPECT_TRUE(test, dd_index_remove(idx, fp, 7));
	for (i = 1; i < 10; i++) {
		dd_test_fp(fp, seeds[i]);
		KUNIT_EXPECT_TRUE(test, dd_index_remove(idx, fp, 100 + i));
	}
	KUNIT_EXPECT_NULL(test, memchr_inv(idx->slots, 0,
					   dd_index_bytes(idx)));
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
 * index cannot tell them apart and must offer both blocks; the caller's
 * full comparison decides. Found by the birthday paradox: 16384
 * fingerprints over 96 * 65536 (home, tag) pairs hold ~20 such pairs.
 */
static void dd_index_test_same_tag(struct kunit *test)
{
	struct dd_index *idx = dd_test_index(test, 64);
	const unsigned int n = 16384;
	struct dd_test_key *keys;
	u8 fp1[DD_FP_SIZE], fp2[DD_FP_SIZE];
	unsigned int i;

	keys = kvcalloc(n, sizeof(*keys), GFP_KERNEL);
	KUNIT_ASSERT_NOT_NULL(test, keys);
	for (i = 0; i < n; i++) {
		dd_test_fp(fp1, i);
		keys[i].key = dd_test_home(idx, fp1) << 16 | dd_test_tag(idx, fp1);
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
	KUNIT_ASSERT_EQ(test, dd_index_insert(idx, fp2, 22), 0);
	KUNIT_EXPECT_TRUE(test, dd_test_has(idx, fp1, 11));
	KUNIT_EXPECT_TRUE(test, dd_test_has(idx, fp1, 22));
	KUNIT_EXPECT_TRUE(test, dd_test_has(idx, fp2, 11));
	KUNIT_EXPECT_TRUE(test, dd_test_has(idx, fp2, 22));
	KUNIT_EXPECT_EQ(test, dd_test_candidates(idx, fp1), 2);

	KUNIT_EXPECT_TRUE(test, dd_index_remove(idx, fp2, 22));
	KUNIT_EXPECT_TRUE(test, dd_test_has(idx, fp1, 11));
	KUNIT_EXPECT_FALSE(test, dd_test_has(idx, fp1, 22));
	KUNIT_EXPECT_EQ(test, dd_test_candidates(idx, fp2), 1);
}

/* One fingerprint on several blocks (a saturated refcount, verify). */
static void dd_index_test_same_fingerprint(struct kunit *test)
{
	struct dd_index *idx = dd_test_index(test, 16);
	u8 fp[DD_FP_SIZE];

	dd_test_fp(fp, 42);
	KUNIT_ASSERT_EQ(test, dd_index_insert(idx, fp, 1), 0);
	KUNIT_ASSERT_EQ(test, dd_index_insert(idx, fp, 2), 0);
	KUNIT_EXPECT_EQ(test, dd_test_candidates(idx, fp), 2);
	KUNIT_EXPECT_TRUE(test, dd_index_remove(idx, fp, 1));
	KUNIT_EXPECT_FALSE(test, dd_test_has(idx, fp, 1));
	KUNIT_EXPECT_TRUE(test, dd_test_has(idx, fp, 2));
}

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

	/* a failed insertion changes nothing */
	before = kunit_kmalloc(test, bytes, GFP_KERNEL);
	KUNIT_ASSERT_NOT_NULL(test, before);
	memcpy(before, idx->slots, bytes);
	dd_test_fp(fp, max);
	KUNIT_EXPECT_EQ(test, dd_index_insert(idx, fp, max), -ENOSPC);
	KUNIT_EXPECT_EQ(test, idx->nr_entries, max);
	KUNIT_EXPECT_MEMEQ(test, idx->slots, before, bytes);

	for (i = 0; i < max; i += 2) {
		dd_test_fp(fp, i);
		KUNIT_EXPECT_TRUE(test, dd_index_remove(idx, fp, i));
	}
	for (i = 0; i < max; i++) {
		dd_test_fp(fp, i);
		KUNIT_EXPECT_EQ_MSG(test, dd_test_has(idx, fp, i), i % 2 == 1,
				    "entry %llu", i);
	}

	for (i = max; i < max + max / 2; i++) {
		dd_test_fp(fp, i);
		KUNIT_EXPECT_EQ(test, dd_index_insert(idx, fp, i), 0);
	}
	dd_test_fp(fp, 2 * max);
	KUNIT_EXPECT_EQ(test, dd_index_insert(idx, fp, 2 * max), -ENOSPC);
	for (i = 1; i < max + max / 2; i++) {
		dd_test_fp(fp, i);
		KUNIT_EXPECT_EQ(test, dd_test_has(idx, fp, i),
				i >= max || i % 2 == 1);
	}
}

/*
 * A slot records at most 255 as its distance from home: 256 fingerprints
 * with one home fit, the 257th is refused before anything moves.
 */
static void dd_index_test_probe_limit(struct kunit *test)
{
	struct dd_index *idx = dd_test_index(test, 400);
	u64 home = 3, *seeds;
	size_t bytes = dd_index_bytes(idx);
	u8 fp[DD_FP_SIZE];
	u64 *before;
	unsigned int i;

	seeds = dd_test_same_home(test, idx, home, 257, 0);
	for (i = 0; i < 256; i++) {
		dd_test_fp(fp, seeds[i]);
		KUNIT_ASSERT_EQ_MSG(test, dd_index_insert(idx, fp, i), 0,
				    "entry %u", i);
	}
	before = kunit_kmalloc(test, bytes, GFP_KERNEL);
	KUNIT_ASSERT_NOT_NULL(test, before);
	memcpy(before, idx->slots, bytes);
	dd_test_fp(fp, seeds[256]);
	KUNIT_EXPECT_EQ(test, dd_index_insert(idx, fp, 256), -ENOSPC);
	KUNIT_EXPECT_MEMEQ(test, idx->slots, before, bytes);
	KUNIT_EXPECT_EQ(test, idx->nr_entries, 256);
	for (i = 0; i < 256; i++) {
		dd_test_fp(fp, seeds[i]);
		KUNIT_EXPECT_TRUE(test, dd_test_has(idx, fp, i));
	}

	dd_test_fp(fp, seeds[100]);
	KUNIT_EXPECT_TRUE(test, dd_index_remove(idx, fp, 100));
	dd_test_fp(fp, seeds[256]);
	KUNIT_EXPECT_EQ(test, dd_index_insert(idx, fp, 256), 0);
	KUNIT_EXPECT_TRUE(test, dd_test_has(idx, fp, 256));
}

static void dd_index_test_pba_range(struct kunit *test)
{
	struct dd_index *idx = dd_test_index(test, 16);
	u8 fp[DD_FP_SIZE];

	dd_test_fp(fp, 1);
	KUNIT_EXPECT_EQ(test, dd_index_insert(idx, fp, 0), 0);
	KUNIT_EXPECT_TRUE(test, dd_test_has(idx, fp, 0));
	dd_test_fp(fp, 2);
	KUNIT_EXPECT_EQ(test, dd_index_insert(idx, fp, DD_INDEX_MAX_PBA), 0);
	KUNIT_EXPECT_TRUE(test, dd_test_has(idx, fp, DD_INDEX_MAX_PBA));
	dd_test_fp(fp, 3);
	KUNIT_EXPECT_EQ(test, dd_index_insert(idx, fp, DD_INDEX_MAX_PBA + 1),
			-ERANGE);
	KUNIT_EXPECT_EQ(test, dd_index_insert(idx, fp, U64_MAX), -ERANGE);
	KUNIT_EXPECT_EQ(test, dd_test_candidates(idx, fp), 0);
	KUNIT_EXPECT_EQ(test, idx->nr_entries, 2);
}

static void dd_index_test_no_capacity(struct kunit *test)
{
	struct dd_index *idx = dd_test_index(test, 0);
	u8 fp[DD_FP_SIZE];

	dd_test_fp(fp, 1);
	KUNIT_EXPECT_EQ(test, dd_index_insert(idx, fp, 1), -ENOSPC);
	KUNIT_EXPECT_EQ(test, dd_test_candidates(idx, fp), 0);
	KUNIT_EXPECT_FALSE(test, dd_index_remove(idx, fp, 1));
}

/* Documentation/dm-dedup.rst promises about 10 bytes of RAM per data block. */
static void dd_index_test_memory(struct kunit *test)
{
	const u64 max = 1 << 20;
	struct dd_index *idx = dd_test_index(test, max);

	KUNIT_EXPECT_EQ(test, dd_index_bytes(idx), idx->nr_slots * sizeof(u64));
	/* load factor at most 0.8 ... */
	KUNIT_EXPECT_GE(test, idx->nr_slots * 4, max * 5);
	/* ... and at most 10 bytes per block, plus a constant */
	KUNIT_EXPECT_LE(test, dd_index_bytes(idx), max * 10 + 128);
}

/*
 * Random inserts and removals against a plain list of what should be
 * there; after every step every live entry must still be found. This
 * exercises displacement and backward shift in combinations the
 * hand-made cases above do not reach.
 */
static void dd_index_test_random_model(struct kunit *test)
{
	const unsigned int max = 200, steps = 3000;
	struct dd_index *idx = dd_test_index(test, max);
	u64 *live = kunit_kcalloc(test, max, sizeof(u64), GFP_KERNEL);
	u64 rnd = 0x2545f4914f6cdd1dULL, next_seed = 0, victim;
	unsigned int n = 0, step, i;
	u8 fp[DD_FP_SIZE];
	bool found;
	int r;

	KUNIT_ASSERT_NOT_NULL(test, live);
	for (step = 0; step < steps; step++) {
		rnd ^= rnd << 13;
		rnd ^= rnd >> 7;
		rnd ^= rnd << 17;
		/* fill up to the limit, then churn around it */
		if (n == 0 || (n < max && rnd % 8 < 5)) {
			dd_test_fp(fp, next_seed);
			r = dd_index_insert(idx, fp, next_seed);
			KUNIT_ASSERT_EQ_MSG(test, r, 0, "step %u", step);
			live[n++] = next_seed++;
		} else {
			i = (rnd >> 8) % n;
			victim = live[i];
			live[i] = live[--n];
			dd_test_fp(fp, victim);
			KUNIT_ASSERT_TRUE_MSG(test,
					      dd_index_remove(idx, fp, victim),
					      "step %u", step);
		}
		KUNIT_ASSERT_EQ(test, idx->nr_entries, n);
		for (i = 0; i < n; i++) {
			dd_test_fp(fp, live[i]);
			found = dd_test_has(idx, fp, live[i]);
			KUNIT_ASSERT_TRUE_MSG(test, found,
					      "step %u, entry %llu", step,
					      live[i]);
		}
	}
}

/*
 * Two activations place the same fingerprints differently: nobody can
 * prepare content that crowds one probe window of the next activation.
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
	/* by chance, 64 / 81936 of them on average */
	KUNIT_EXPECT_LT(test, same, 4);
}

static struct kunit_case dd_index_cases[] = {
	KUNIT_CASE(dd_index_test_insert_find_remove),
	KUNIT_CASE(dd_index_test_home_slot),
	KUNIT_CASE(dd_index_test_same_home),
	KUNIT_CASE(dd_index_test_wraparound),
	KUNIT_CASE(dd_index_test_same_tag),
	KUNIT_CASE(dd_index_test_same_fingerprint),
	KUNIT_CASE(dd_index_test_full),
	KUNIT_CASE(dd_index_test_probe_limit),
	KUNIT_CASE(dd_index_test_pba_range),
	KUNIT_CASE(dd_index_test_no_capacity),
	KUNIT_CASE(dd_index_test_memory),
	KUNIT_CASE(dd_index_test_random_model),
	KUNIT_CASE(dd_index_test_keyed),
	{}
};

static struct kunit_suite dd_index_suite = {
	.name = "dm_dedup_index",
	.test_cases = dd_index_cases,
};

kunit_test_suite(dd_index_suite);
