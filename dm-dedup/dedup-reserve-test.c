// SPDX-License-Identifier: GPL-2.0-only
/*
 * KUnit tests of the per-CPU reservations (dedup-reserve.c): a run hands
 * out its blocks in order and never more than it holds, a full run is
 * not refilled over, and a drain takes back exactly what is left.
 */
#include <kunit/test.h>

#include "dedup-reserve.h"

static void dd_reserve_test_init(struct kunit *test, struct dd_reserve *rs)
{
	KUNIT_ASSERT_EQ(test, dd_reserve_init(rs), 0);
}

static void dd_reserve_test_empty(struct kunit *test)
{
	struct dd_reserve rs;
	u64 first = 7, len = 7;

	dd_reserve_test_init(test, &rs);
	KUNIT_EXPECT_EQ(test, dd_reserve_take(&rs, 4, &first), 0);
	KUNIT_EXPECT_FALSE(test, dd_reserve_drain(&rs, &first, &len));
	dd_reserve_exit(&rs);
}

static void dd_reserve_test_take_in_order(struct kunit *test)
{
	struct dd_reserve rs;
	u64 first = 0, len = 0;

	dd_reserve_test_init(test, &rs);
	KUNIT_ASSERT_TRUE(test, dd_reserve_fill(&rs, 100, 10));
	KUNIT_EXPECT_EQ(test, dd_reserve_take(&rs, 1, &first), 1);
	KUNIT_EXPECT_EQ(test, first, 100);
	KUNIT_EXPECT_EQ(test, dd_reserve_take(&rs, 4, &first), 4);
	KUNIT_EXPECT_EQ(test, first, 101);
	/* Five are left: a request for more gets those, then nothing. */
	KUNIT_EXPECT_EQ(test, dd_reserve_take(&rs, 16, &first), 5);
	KUNIT_EXPECT_EQ(test, first, 105);
	KUNIT_EXPECT_EQ(test, dd_reserve_take(&rs, 1, &first), 0);
	KUNIT_EXPECT_FALSE(test, dd_reserve_drain(&rs, &first, &len));
	dd_reserve_exit(&rs);
}

static void dd_reserve_test_fill_only_empty(struct kunit *test)
{
	struct dd_reserve rs;
	u64 first = 0, len = 0;

	dd_reserve_test_init(test, &rs);
	KUNIT_ASSERT_TRUE(test, dd_reserve_fill(&rs, 0, 64));
	KUNIT_EXPECT_EQ(test, dd_reserve_take(&rs, 3, &first), 3);
	/* The 61 left stay; the caller keeps the blocks it offered. */
	KUNIT_EXPECT_FALSE(test, dd_reserve_fill(&rs, 500, 64));
	KUNIT_EXPECT_EQ(test, dd_reserve_take(&rs, 1, &first), 1);
	KUNIT_EXPECT_EQ(test, first, 3);
	KUNIT_ASSERT_TRUE(test, dd_reserve_drain(&rs, &first, &len));
	KUNIT_EXPECT_EQ(test, first, 4);
	KUNIT_EXPECT_EQ(test, len, 60);
	/* Drained: empty, and fillable again. */
	KUNIT_EXPECT_FALSE(test, dd_reserve_drain(&rs, &first, &len));
	KUNIT_EXPECT_EQ(test, dd_reserve_take(&rs, 1, &first), 0);
	KUNIT_EXPECT_TRUE(test, dd_reserve_fill(&rs, 500, 64));
	KUNIT_EXPECT_EQ(test, dd_reserve_take(&rs, 1, &first), 1);
	KUNIT_EXPECT_EQ(test, first, 500);
	dd_reserve_exit(&rs);
}

static struct kunit_case dd_reserve_cases[] = {
	KUNIT_CASE(dd_reserve_test_empty),
	KUNIT_CASE(dd_reserve_test_take_in_order),
	KUNIT_CASE(dd_reserve_test_fill_only_empty),
	{}
};

static struct kunit_suite dd_reserve_suite = {
	.name = "dm_dedup_reserve",
	.test_cases = dd_reserve_cases,
};

kunit_test_suite(dd_reserve_suite);
