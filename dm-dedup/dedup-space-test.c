// SPDX-License-Identifier: GPL-2.0-only
/*
 * KUnit tests of the block allocator with commit-deferred frees
 * (dedup-space.c), used for both physical and metadata blocks.
 */
#include <kunit/resource.h>
#include <kunit/test.h>

#include "dedup-space.h"
#include "dedup-test-util.h"

KUNIT_DEFINE_ACTION_WRAPPER(dd_test_space_put, dd_space_exit,
			    struct dd_space *);

static struct dd_space *dd_test_space(struct kunit *test, u64 nr_blocks,
				      u64 first)
{
	struct dd_space *s = kunit_kzalloc(test, sizeof(*s), GFP_KERNEL);

	KUNIT_ASSERT_NOT_NULL(test, s);
	KUNIT_ASSERT_EQ(test, dd_space_init(s, nr_blocks, first), 0);
	KUNIT_ASSERT_EQ(test,
			kunit_add_action_or_reset(test, dd_test_space_put, s),
			0);
	return s;
}

static u64 dd_test_alloc(struct kunit *test, struct dd_space *s)
{
	u64 b = U64_MAX;

	KUNIT_ASSERT_EQ(test, dd_space_alloc(s, &b), 0);
	return b;
}

/* Every free block allocated, in order: a full device. */
static void dd_test_fill(struct kunit *test, struct dd_space *s)
{
	while (dd_space_free_blocks(s))
		dd_test_alloc(test, s);
}

/* Records what dd_space_commit() reports as freed. */
struct dd_test_runs {
	unsigned int n;
	u64 begin[8];
	u64 end[8];
};

static void dd_test_record(void *ctx, u64 begin, u64 end)
{
	struct dd_test_runs *runs = ctx;

	if (runs->n < ARRAY_SIZE(runs->begin)) {
		runs->begin[runs->n] = begin;
		runs->end[runs->n] = end;
	}
	runs->n++;
}

static void dd_space_test_init_bounds(struct kunit *test)
{
	struct dd_space s;
	u64 b;

	KUNIT_EXPECT_EQ(test, dd_space_init(&s, 10, 11), -EINVAL);
	dd_space_exit(&s);

	/* nothing to hand out, but a valid state */
	KUNIT_ASSERT_EQ(test, dd_space_init(&s, 10, 10), 0);
	KUNIT_EXPECT_EQ(test, dd_space_free_blocks(&s), 0);
	KUNIT_EXPECT_EQ(test, dd_space_alloc(&s, &b), -ENOSPC);
	dd_space_exit(&s);

	KUNIT_ASSERT_EQ(test, dd_space_init(&s, 0, 0), 0);
	KUNIT_EXPECT_EQ(test, dd_space_alloc(&s, &b), -ENOSPC);
	KUNIT_EXPECT_FALSE(test, dd_space_is_used(&s, 0));
	dd_space_exit(&s);
}

/*
 * Blocks come out in order, up to and including the last one, which
 * sits in a partial bitmap word (70 is not a multiple of BITS_PER_LONG).
 */
static void dd_space_test_alloc_in_order(struct kunit *test)
{
	struct dd_space *s = dd_test_space(test, 70, 3);
	u64 b, i;

	KUNIT_EXPECT_EQ(test, dd_space_free_blocks(s), 67);
	/* the reserved head counts as used */
	for (i = 0; i < 3; i++)
		KUNIT_EXPECT_TRUE(test, dd_space_is_used(s, i));
	for (i = 3; i < 70; i++) {
		KUNIT_EXPECT_FALSE(test, dd_space_is_used(s, i));
		KUNIT_EXPECT_EQ(test, dd_test_alloc(test, s), i);
		KUNIT_EXPECT_TRUE(test, dd_space_is_used(s, i));
	}
	KUNIT_EXPECT_EQ(test, dd_space_free_blocks(s), 0);
	KUNIT_EXPECT_EQ(test, dd_space_alloc(s, &b), -ENOSPC);
	KUNIT_EXPECT_FALSE(test, dd_space_is_used(s, 70));
}

/* Next fit: a hole behind the cursor waits until the cursor wraps. */
static void dd_space_test_next_fit(struct kunit *test)
{
	struct dd_space *s = dd_test_space(test, 20, 2);
	u64 i;

	for (i = 2; i < 10; i++)
		dd_test_alloc(test, s);
	dd_space_free_now(s, 5);
	KUNIT_EXPECT_FALSE(test, dd_space_is_used(s, 5));
	KUNIT_EXPECT_EQ(test, dd_test_alloc(test, s), 10);
	for (i = 11; i < 20; i++)
		KUNIT_EXPECT_EQ(test, dd_test_alloc(test, s), i);
	/* the cursor wrapped to first, not to 0 */
	KUNIT_EXPECT_EQ(test, dd_test_alloc(test, s), 5);
	dd_space_free_now(s, 19);
	dd_space_free_now(s, 2);
	KUNIT_EXPECT_EQ(test, dd_test_alloc(test, s), 19);
	KUNIT_EXPECT_EQ(test, dd_test_alloc(test, s), 2);
	KUNIT_EXPECT_EQ(test, dd_space_free_blocks(s), 0);
}

static void dd_space_test_mark_used(struct kunit *test)
{
	struct dd_space *s = dd_test_space(test, 16, 2);

	KUNIT_EXPECT_EQ(test, dd_space_mark_used(s, 0), -ERANGE);
	KUNIT_EXPECT_EQ(test, dd_space_mark_used(s, 1), -ERANGE);
	KUNIT_EXPECT_EQ(test, dd_space_mark_used(s, 16), -ERANGE);
	KUNIT_EXPECT_EQ(test, dd_space_mark_used(s, U64_MAX), -ERANGE);
	KUNIT_EXPECT_EQ(test, dd_space_mark_used(s, 2), 0);
	KUNIT_EXPECT_EQ(test, dd_space_mark_used(s, 15), 0);
	KUNIT_EXPECT_EQ(test, dd_space_mark_used(s, 4), 0);
	KUNIT_EXPECT_EQ(test, dd_space_mark_used(s, 4), -EEXIST);
	KUNIT_EXPECT_EQ(test, dd_space_free_blocks(s), 11);
	KUNIT_EXPECT_EQ(test, dd_test_alloc(test, s), 3);
	KUNIT_EXPECT_EQ(test, dd_test_alloc(test, s), 5);
}

/*
 * A released block may still be referenced by the last commit: it stays
 * allocated, even when nothing else is free, until dd_space_commit().
 */
static void dd_space_test_release_waits_for_commit(struct kunit *test)
{
	struct dd_space *s = dd_test_space(test, 8, 2);
	struct dd_test_runs runs = {};
	u64 b;

	dd_test_fill(test, s);
	dd_space_release(s, 4);
	dd_space_release(s, 4);	/* counted once */
	dd_space_release(s, 7);
	KUNIT_EXPECT_EQ(test, s->nr_pending, 2);
	KUNIT_EXPECT_TRUE(test, dd_space_is_used(s, 4));
	KUNIT_EXPECT_TRUE(test, dd_space_is_used(s, 7));
	KUNIT_EXPECT_EQ(test, dd_space_free_blocks(s), 0);
	KUNIT_EXPECT_EQ(test, dd_space_alloc(s, &b), -ENOSPC);

	dd_space_commit(s, dd_test_record, &runs);
	KUNIT_EXPECT_EQ(test, s->nr_pending, 0);
	KUNIT_EXPECT_EQ(test, dd_space_free_blocks(s), 2);
	KUNIT_EXPECT_FALSE(test, dd_space_is_used(s, 4));
	KUNIT_ASSERT_EQ(test, runs.n, 2);
	KUNIT_EXPECT_EQ(test, runs.begin[0], 4);
	KUNIT_EXPECT_EQ(test, runs.end[0], 5);
	KUNIT_EXPECT_EQ(test, runs.begin[1], 7);
	KUNIT_EXPECT_EQ(test, runs.end[1], 8);

	/* the cursor went back to first after block 7: 4 comes first */
	KUNIT_EXPECT_EQ(test, dd_test_alloc(test, s), 4);
	KUNIT_EXPECT_EQ(test, dd_test_alloc(test, s), 7);
	KUNIT_EXPECT_EQ(test, dd_space_alloc(s, &b), -ENOSPC);

	/* a commit with nothing pending reports nothing */
	runs.n = 0;
	dd_space_commit(s, dd_test_record, &runs);
	KUNIT_EXPECT_EQ(test, runs.n, 0);
}

/* Adjacent pending blocks are reported as one run, up to the last block. */
static void dd_space_test_commit_runs(struct kunit *test)
{
	struct dd_space *s = dd_test_space(test, 130, 1);
	struct dd_test_runs runs = {};
	u64 i;

	dd_test_fill(test, s);
	/* 63..65 straddles the first bitmap word boundary */
	for (i = 63; i <= 65; i++)
		dd_space_release(s, i);
	dd_space_release(s, 100);
	dd_space_release(s, 129);
	dd_space_release(s, 1);
	KUNIT_EXPECT_EQ(test, s->nr_pending, 6);
	dd_space_commit(s, dd_test_record, &runs);
	KUNIT_ASSERT_EQ(test, runs.n, 4);
	KUNIT_EXPECT_EQ(test, runs.begin[0], 1);
	KUNIT_EXPECT_EQ(test, runs.end[0], 2);
	KUNIT_EXPECT_EQ(test, runs.begin[1], 63);
	KUNIT_EXPECT_EQ(test, runs.end[1], 66);
	KUNIT_EXPECT_EQ(test, runs.begin[2], 100);
	KUNIT_EXPECT_EQ(test, runs.end[2], 101);
	KUNIT_EXPECT_EQ(test, runs.begin[3], 129);
	KUNIT_EXPECT_EQ(test, runs.end[3], 130);
	KUNIT_EXPECT_EQ(test, dd_space_free_blocks(s), 6);
	KUNIT_EXPECT_EQ(test, s->nr_used, 124);
	/* without a callback the blocks are freed all the same */
	dd_space_release(s, 50);
	dd_space_commit(s, NULL, NULL);
	KUNIT_EXPECT_FALSE(test, dd_space_is_used(s, 50));
	KUNIT_EXPECT_EQ(test, dd_space_free_blocks(s), 7);
}

/* free_now must not undo a release: the commit still references it. */
static void dd_space_test_free_now_of_pending(struct kunit *test)
{
	struct dd_space *s = dd_test_space(test, 4, 0);
	u64 b;

	dd_test_fill(test, s);
	dd_space_release(s, 0);
	dd_space_free_now(s, 0);
	KUNIT_EXPECT_TRUE(test, dd_space_is_used(s, 0));
	KUNIT_EXPECT_EQ(test, dd_space_alloc(s, &b), -ENOSPC);
	KUNIT_EXPECT_EQ(test, s->nr_pending, 1);
	dd_space_commit(s, NULL, NULL);
	KUNIT_EXPECT_EQ(test, s->nr_used, 3);
	KUNIT_EXPECT_EQ(test, dd_test_alloc(test, s), 0);
	KUNIT_EXPECT_EQ(test, s->nr_used, 4);
}

/* Whatever the cursor does, nothing below first is ever handed out. */
static void dd_space_test_first_honoured(struct kunit *test)
{
	struct dd_space *s = dd_test_space(test, 40, 10);
	unsigned int round;
	u64 b, i;

	for (round = 0; round < 3; round++) {
		for (i = 0; i < 30; i++) {
			b = dd_test_alloc(test, s);
			KUNIT_EXPECT_GE(test, b, 10);
			KUNIT_EXPECT_LT(test, b, 40);
		}
		KUNIT_EXPECT_EQ(test, dd_space_alloc(s, &b), -ENOSPC);
		for (i = 10; i < 40; i += 1 + round)
			dd_space_release(s, i);
		dd_space_commit(s, NULL, NULL);
		while (dd_space_alloc(s, &b) == 0)
			KUNIT_EXPECT_GE(test, b, 10);
		for (i = 10; i < 40; i++)
			dd_space_release(s, i);
		dd_space_commit(s, NULL, NULL);
		KUNIT_EXPECT_EQ(test, dd_space_free_blocks(s), 30);
	}
	for (i = 0; i < 10; i++)
		KUNIT_EXPECT_TRUE(test, dd_space_is_used(s, i));
}

/* A million blocks: the counters stay exact through full cycles. */
/* Runs stop at a used block, wrap to the start, and never pass the end. */
static void dd_space_test_alloc_run(struct kunit *test)
{
	struct dd_space *s = dd_test_space(test, 16, 2);
	u64 first = U64_MAX, len = U64_MAX;

	KUNIT_ASSERT_EQ(test, dd_space_alloc_run(s, 4, &first, &len), 0);
	KUNIT_EXPECT_EQ(test, first, 2);
	KUNIT_EXPECT_EQ(test, len, 4);
	KUNIT_ASSERT_EQ(test, dd_space_mark_used(s, 9), 0);
	/* 6, 7 and 8 are free, 9 is not: the run stops there. */
	KUNIT_ASSERT_EQ(test, dd_space_alloc_run(s, 8, &first, &len), 0);
	KUNIT_EXPECT_EQ(test, first, 6);
	KUNIT_EXPECT_EQ(test, len, 3);
	/* The cursor is at 9: the next run starts after it, up to the end. */
	KUNIT_ASSERT_EQ(test, dd_space_alloc_run(s, 100, &first, &len), 0);
	KUNIT_EXPECT_EQ(test, first, 10);
	KUNIT_EXPECT_EQ(test, len, 6);
	KUNIT_EXPECT_EQ(test, dd_space_free_blocks(s), 0);
	KUNIT_EXPECT_EQ(test, dd_space_alloc_run(s, 1, &first, &len), -ENOSPC);
	KUNIT_EXPECT_EQ(test, dd_space_alloc_run(s, 0, &first, &len), -ENOSPC);

	/* A block freed behind the cursor is found by wrapping. */
	dd_space_free_now(s, 3);
	dd_space_free_now(s, 4);
	KUNIT_ASSERT_EQ(test, dd_space_alloc_run(s, 8, &first, &len), 0);
	KUNIT_EXPECT_EQ(test, first, 3);
	KUNIT_EXPECT_EQ(test, len, 2);
	KUNIT_EXPECT_EQ(test, s->nr_used, 16);
}

static void dd_space_test_large(struct kunit *test)
{
	const u64 nr = 1 << 20;
	struct dd_space *s = dd_test_space(test, nr, 0);
	u64 i, b;

	for (i = 0; i < nr; i++)
		KUNIT_ASSERT_EQ(test, dd_test_alloc(test, s), i);
	KUNIT_EXPECT_EQ(test, dd_space_alloc(s, &b), -ENOSPC);
	for (i = 0; i < nr; i += 3)
		dd_space_release(s, i);
	dd_space_commit(s, NULL, NULL);
	KUNIT_EXPECT_EQ(test, dd_space_free_blocks(s), (nr + 2) / 3);
	/* the cursor went back to 0 after the last block: holes in order */
	for (i = 0; i < nr; i += 3)
		KUNIT_ASSERT_EQ(test, dd_test_alloc(test, s), i);
	KUNIT_EXPECT_EQ(test, dd_space_free_blocks(s), 0);
}

/*
 * An allocator that holds frees keeps a committed free allocated until it
 * is released, run by run: a discard in flight never meets new data.
 */
static void dd_space_test_hold_frees(struct kunit *test)
{
	struct dd_space *s = dd_test_space(test, 8, 0);
	struct dd_test_runs runs = {};
	u64 b, e;

	KUNIT_ASSERT_EQ(test, dd_space_hold_frees(s), 0);
	dd_test_fill(test, s);
	dd_space_release(s, 2);
	dd_space_release(s, 3);
	dd_space_release(s, 6);
	dd_space_commit(s, dd_test_record, &runs);
	KUNIT_EXPECT_EQ(test, runs.n, 0U);	/* nothing free yet */
	KUNIT_EXPECT_EQ(test, s->nr_held, 3ULL);
	KUNIT_EXPECT_EQ(test, dd_space_free_blocks(s), 0ULL);
	KUNIT_EXPECT_EQ(test, dd_space_alloc(s, &b), -ENOSPC);

	/* Freed in the next transaction while the first is held. */
	dd_space_release(s, 7);
	KUNIT_ASSERT_TRUE(test, dd_space_held_run(s, 0, &b, &e));
	KUNIT_EXPECT_EQ(test, b, 2ULL);
	KUNIT_EXPECT_EQ(test, e, 4ULL);
	dd_space_release_held(s, b, e);
	KUNIT_EXPECT_EQ(test, dd_space_free_blocks(s), 2ULL);
	KUNIT_ASSERT_TRUE(test, dd_space_held_run(s, e, &b, &e));
	KUNIT_EXPECT_EQ(test, b, 6ULL);
	KUNIT_EXPECT_EQ(test, e, 7ULL);
	dd_space_release_held(s, b, e);
	KUNIT_EXPECT_FALSE(test, dd_space_held_run(s, 0, &b, &e));
	KUNIT_EXPECT_EQ(test, s->nr_held, 0ULL);
	KUNIT_EXPECT_EQ(test, dd_space_free_blocks(s), 3ULL);
	KUNIT_EXPECT_TRUE(test, dd_space_is_used(s, 7));	/* still pending */
	dd_space_commit(s, NULL, NULL);
	KUNIT_EXPECT_EQ(test, s->nr_held, 1ULL);
}

/*
 * An allocator that cools frees reuses a block released in transaction T
 * only after T + 1 has committed: the older superblock slot still names
 * T - 1, which may reference it. Frees of T + 1 cool in their turn, and
 * held frees (discard passdown) are held only once they are past cooling.
 */
static void dd_space_test_cool_frees(struct kunit *test)
{
	struct dd_space *s = dd_test_space(test, 8, 0);
	struct dd_test_runs runs = {};
	u64 b, e;

	KUNIT_ASSERT_EQ(test, dd_space_cool_frees(s), 0);
	dd_test_fill(test, s);
	dd_space_release(s, 2);
	dd_space_release(s, 3);
	KUNIT_EXPECT_EQ(test, dd_space_frees_to_come(s), 2ULL);
	dd_space_commit(s, dd_test_record, &runs);		/* T */
	KUNIT_EXPECT_EQ(test, runs.n, 0U);
	KUNIT_EXPECT_EQ(test, s->nr_pending, 0ULL);
	KUNIT_EXPECT_EQ(test, s->nr_cooling, 2ULL);
	KUNIT_EXPECT_EQ(test, dd_space_frees_to_come(s), 2ULL);
	KUNIT_EXPECT_EQ(test, dd_space_alloc(s, &b), -ENOSPC);

	dd_space_release(s, 6);					/* in T + 1 */
	dd_space_commit(s, dd_test_record, &runs);		/* T + 1 */
	KUNIT_ASSERT_EQ(test, runs.n, 1U);
	KUNIT_EXPECT_EQ(test, runs.begin[0], 2ULL);
	KUNIT_EXPECT_EQ(test, runs.end[0], 4ULL);
	KUNIT_EXPECT_EQ(test, s->nr_cooling, 1ULL);
	KUNIT_EXPECT_EQ(test, dd_space_free_blocks(s), 2ULL);
	KUNIT_EXPECT_TRUE(test, dd_space_is_used(s, 6));
	KUNIT_EXPECT_EQ(test, dd_test_alloc(test, s), 2ULL);

	dd_space_commit(s, dd_test_record, &runs);		/* T + 2: nothing new */
	KUNIT_ASSERT_EQ(test, runs.n, 2U);
	KUNIT_EXPECT_EQ(test, runs.begin[1], 6ULL);
	KUNIT_EXPECT_EQ(test, s->nr_cooling, 0ULL);
	KUNIT_EXPECT_EQ(test, dd_space_frees_to_come(s), 0ULL);
	dd_space_commit(s, dd_test_record, &runs);
	KUNIT_EXPECT_EQ(test, runs.n, 2U);

	/* With held frees: cooling first, then held until released. */
	KUNIT_ASSERT_EQ(test, dd_space_hold_frees(s), 0);
	dd_space_release(s, 0);
	dd_space_commit(s, NULL, NULL);
	KUNIT_EXPECT_EQ(test, s->nr_held, 0ULL);
	KUNIT_EXPECT_EQ(test, s->nr_cooling, 1ULL);
	dd_space_commit(s, NULL, NULL);
	KUNIT_EXPECT_EQ(test, s->nr_held, 1ULL);
	KUNIT_EXPECT_EQ(test, dd_space_frees_to_come(s), 1ULL);
	KUNIT_ASSERT_TRUE(test, dd_space_held_run(s, 0, &b, &e));
	KUNIT_EXPECT_EQ(test, b, 0ULL);
	dd_space_release_held(s, b, e);
	KUNIT_EXPECT_FALSE(test, dd_space_is_used(s, 0));
}

/*
 * The words a clean close saves are the blocks the last commit holds,
 * and loading them into an empty allocator gives back the same state.
 */
static void dd_space_test_saved_words(struct kunit *test)
{
	struct dd_space *s = dd_test_space(test, 200, 2);
	struct dd_space *t = dd_test_space(test, 200, 2);
	u64 b, w[4];
	int i;

	KUNIT_ASSERT_EQ(test, dd_space_cool_frees(s), 0);
	for (b = 2; b < 140; b++)
		dd_test_alloc(test, s);
	dd_space_release(s, 5);		/* pending */
	dd_space_commit(s, NULL, NULL);	/* 5 cooling */
	dd_space_release(s, 70);	/* pending */
	for (i = 0; i < 4; i++)
		w[i] = dd_space_committed_word(s, i);
	/* the head is implied, 5 and 70 are on their way out */
	KUNIT_EXPECT_EQ(test, w[0], ~0ULL << 2 & ~(1ULL << 5));
	KUNIT_EXPECT_EQ(test, w[1], ~0ULL & ~(1ULL << 6));
	KUNIT_EXPECT_EQ(test, w[2], (1ULL << 12) - 1);
	KUNIT_EXPECT_EQ(test, w[3], 0);
	KUNIT_EXPECT_EQ(test, dd_space_committed_word(s, 9), 0);

	for (i = 0; i < 4; i++)
		KUNIT_ASSERT_EQ(test, dd_space_load_word(t, i, w[i]), 0);
	KUNIT_EXPECT_EQ(test, t->nr_used, 2 + 138 - 2);
	/* what was on its way out is free in the loaded state */
	KUNIT_EXPECT_EQ(test, dd_test_alloc(test, t), 5);
	KUNIT_EXPECT_EQ(test, dd_test_alloc(test, t), 70);
	KUNIT_EXPECT_EQ(test, dd_test_alloc(test, t), 140);
	/* a block taken twice, the head, or past the end: refused */
	KUNIT_EXPECT_EQ(test, dd_space_load_word(t, 1, 1), -EEXIST);
	KUNIT_EXPECT_EQ(test, dd_space_load_word(t, 0, 1), -ERANGE);
	KUNIT_EXPECT_EQ(test, dd_space_load_word(t, 3, 1ULL << 8), -ERANGE);

	/* everything taken leaves at the next commit */
	dd_space_release_all(t);
	KUNIT_EXPECT_EQ(test, t->nr_pending, t->nr_used - 2);
	dd_space_commit(t, NULL, NULL);
	KUNIT_EXPECT_EQ(test, t->nr_used, 2);

	dd_space_reset(s);
	KUNIT_EXPECT_EQ(test, s->nr_used, 2);
	KUNIT_EXPECT_EQ(test, s->nr_pending + s->nr_cooling, 0);
	KUNIT_EXPECT_EQ(test, dd_test_alloc(test, s), 2);
}

static struct kunit_case dd_space_cases[] = {
	KUNIT_CASE(dd_space_test_init_bounds),
	KUNIT_CASE(dd_space_test_alloc_in_order),
	KUNIT_CASE(dd_space_test_next_fit),
	KUNIT_CASE(dd_space_test_mark_used),
	KUNIT_CASE(dd_space_test_release_waits_for_commit),
	KUNIT_CASE(dd_space_test_commit_runs),
	KUNIT_CASE(dd_space_test_free_now_of_pending),
	KUNIT_CASE(dd_space_test_first_honoured),
	KUNIT_CASE(dd_space_test_alloc_run),
	KUNIT_CASE(dd_space_test_large),
	KUNIT_CASE(dd_space_test_hold_frees),
	KUNIT_CASE(dd_space_test_cool_frees),
	KUNIT_CASE(dd_space_test_saved_words),
	{}
};

static struct kunit_suite dd_space_suite = {
	.name = "dm_dedup_space",
	.test_cases = dd_space_cases,
};

kunit_test_suite(dd_space_suite);
