// SPDX-License-Identifier: GPL-2.0-only
/*
 * KUnit tests of logical block cells (dedup-cell.c): a change goes ahead
 * only after every overlapping change entered before it has left, never
 * waits for a later one, and one that overlaps nothing goes at once.
 */
#include <kunit/test.h>

#include "dedup-cell.h"

#define DD_TEST_CELLS	6

struct dd_test_change {
	struct dd_cell cell;
	int went;		/* order in which it went ahead, from 1 */
};

static int dd_test_turn;

static void dd_test_ready(struct dd_cell *cell)
{
	container_of(cell, struct dd_test_change, cell)->went = ++dd_test_turn;
}

static void dd_test_enter(struct dd_cells *cells, struct dd_test_change *c,
			  u64 begin, u64 end)
{
	c->went = 0;
	dd_cell_enter(cells, &c->cell, begin, end, dd_test_ready);
}

/* The owner is ready: true if it went ahead at once. */
static bool dd_test_arm(struct dd_cells *cells, struct dd_test_change *c)
{
	if (!dd_cell_arm(cells, &c->cell))
		return false;
	c->went = ++dd_test_turn;
	return true;
}

static void dd_cell_test_disjoint_go_at_once(struct kunit *test)
{
	struct dd_test_change c[3];
	struct dd_cells cells;

	dd_cells_init(&cells);
	dd_test_turn = 0;
	dd_test_enter(&cells, &c[0], 0, 64);
	dd_test_enter(&cells, &c[1], 64, 128);	/* adjacent, not overlapping */
	dd_test_enter(&cells, &c[2], 1000, 1001);
	KUNIT_EXPECT_TRUE(test, dd_test_arm(&cells, &c[2]));
	KUNIT_EXPECT_TRUE(test, dd_test_arm(&cells, &c[1]));
	KUNIT_EXPECT_TRUE(test, dd_test_arm(&cells, &c[0]));
	KUNIT_EXPECT_EQ(test, cells.waits, 0ULL);
	dd_cell_leave(&cells, &c[1].cell);
	dd_cell_leave(&cells, &c[0].cell);
	dd_cell_leave(&cells, &c[2].cell);
	KUNIT_EXPECT_TRUE(test, dd_cells_empty(&cells));
}

/*
 * A later change armed first waits for the earlier one to leave, and a
 * third one behind both waits for both.
 */
static void dd_cell_test_overlap_in_entry_order(struct kunit *test)
{
	struct dd_test_change c[3];
	struct dd_cells cells;

	dd_cells_init(&cells);
	dd_test_turn = 0;
	dd_test_enter(&cells, &c[0], 10, 20);
	dd_test_enter(&cells, &c[1], 15, 16);
	dd_test_enter(&cells, &c[2], 0, 100);
	KUNIT_EXPECT_EQ(test, cells.waits, 2ULL);
	KUNIT_EXPECT_FALSE(test, dd_test_arm(&cells, &c[2]));
	KUNIT_EXPECT_FALSE(test, dd_test_arm(&cells, &c[1]));
	KUNIT_EXPECT_EQ(test, dd_test_turn, 0);
	KUNIT_EXPECT_TRUE(test, dd_test_arm(&cells, &c[0]));
	dd_cell_leave(&cells, &c[0].cell);
	KUNIT_EXPECT_EQ(test, c[1].went, 2);
	KUNIT_EXPECT_EQ(test, c[2].went, 0);
	dd_cell_leave(&cells, &c[1].cell);
	KUNIT_EXPECT_EQ(test, c[2].went, 3);
	dd_cell_leave(&cells, &c[2].cell);
	KUNIT_EXPECT_TRUE(test, dd_cells_empty(&cells));
}

/* A change whose turn came while its owner was busy goes when armed. */
static void dd_cell_test_turn_before_arm(struct kunit *test)
{
	struct dd_test_change c[2];
	struct dd_cells cells;

	dd_cells_init(&cells);
	dd_test_turn = 0;
	dd_test_enter(&cells, &c[0], 5, 6);
	dd_test_enter(&cells, &c[1], 5, 6);
	KUNIT_EXPECT_TRUE(test, dd_test_arm(&cells, &c[0]));
	dd_cell_leave(&cells, &c[0].cell);
	KUNIT_EXPECT_EQ(test, c[1].went, 0);	/* not armed yet */
	KUNIT_EXPECT_TRUE(test, dd_test_arm(&cells, &c[1]));
	KUNIT_EXPECT_EQ(test, c[1].went, 2);
	dd_cell_leave(&cells, &c[1].cell);
}

/*
 * A change that ends early (it failed before its turn) releases the later
 * ones it held, but never the earlier ones it was waiting for.
 */
static void dd_cell_test_early_leave_spares_earlier(struct kunit *test)
{
	struct dd_test_change c[3];
	struct dd_cells cells;

	dd_cells_init(&cells);
	dd_test_turn = 0;
	dd_test_enter(&cells, &c[0], 0, 8);
	dd_test_enter(&cells, &c[1], 4, 12);
	dd_test_enter(&cells, &c[2], 8, 16);	/* overlaps c[1] only */
	KUNIT_EXPECT_FALSE(test, dd_test_arm(&cells, &c[2]));
	dd_cell_leave(&cells, &c[1].cell);
	KUNIT_EXPECT_EQ(test, c[2].went, 1);
	KUNIT_EXPECT_EQ(test, c[0].went, 0);
	KUNIT_EXPECT_TRUE(test, dd_test_arm(&cells, &c[0]));
	dd_cell_leave(&cells, &c[0].cell);
	dd_cell_leave(&cells, &c[2].cell);
	KUNIT_EXPECT_TRUE(test, dd_cells_empty(&cells));
}

/*
 * Many changes over one block, armed in reverse: they go strictly in the
 * order they entered, one at a time.
 */
static void dd_cell_test_chain_on_one_block(struct kunit *test)
{
	struct dd_test_change c[DD_TEST_CELLS];
	struct dd_cells cells;
	int i;

	dd_cells_init(&cells);
	dd_test_turn = 0;
	for (i = 0; i < DD_TEST_CELLS; i++)
		dd_test_enter(&cells, &c[i], 7 - i % 2, 8);
	for (i = DD_TEST_CELLS - 1; i > 0; i--)
		KUNIT_EXPECT_FALSE(test, dd_test_arm(&cells, &c[i]));
	KUNIT_EXPECT_TRUE(test, dd_test_arm(&cells, &c[0]));
	for (i = 0; i < DD_TEST_CELLS; i++) {
		KUNIT_EXPECT_EQ(test, c[i].went, i + 1);
		if (i + 1 < DD_TEST_CELLS)
			KUNIT_EXPECT_EQ(test, c[i + 1].went, 0);
		dd_cell_leave(&cells, &c[i].cell);
	}
	KUNIT_EXPECT_TRUE(test, dd_cells_empty(&cells));
}

/*
 * A read of blocks a change is writing waits behind it, and only then:
 * it enters nothing when nothing overlaps, and a later change of its
 * block waits for the read in turn.
 */
static void dd_cell_test_read_behind_write(struct kunit *test)
{
	struct dd_test_change w[2], rd, late;
	struct dd_cells cells;

	dd_cells_init(&cells);
	dd_test_turn = 0;
	dd_test_enter(&cells, &w[0], 10, 20);
	KUNIT_EXPECT_TRUE(test, dd_test_arm(&cells, &w[0]));
	KUNIT_EXPECT_FALSE(test, dd_cells_busy(&cells, 0, 10));
	KUNIT_EXPECT_TRUE(test, dd_cells_busy(&cells, 19, 21));
	rd.went = 0;
	KUNIT_EXPECT_FALSE(test, dd_cell_enter_behind(&cells, &rd.cell, 20, 21,
						      dd_test_ready));
	KUNIT_EXPECT_TRUE(test, dd_cell_enter_behind(&cells, &rd.cell, 15, 16,
						     dd_test_ready));
	dd_test_enter(&cells, &late, 15, 16);
	KUNIT_EXPECT_FALSE(test, dd_test_arm(&cells, &late));
	/* A change elsewhere neither waits for the read nor frees it. */
	dd_test_enter(&cells, &w[1], 30, 31);
	KUNIT_EXPECT_TRUE(test, dd_test_arm(&cells, &w[1]));
	dd_cell_leave(&cells, &w[1].cell);
	KUNIT_EXPECT_EQ(test, rd.went, 0);
	dd_cell_leave(&cells, &w[0].cell);
	KUNIT_EXPECT_EQ(test, rd.went, 3);
	KUNIT_EXPECT_EQ(test, late.went, 0);
	dd_cell_leave(&cells, &rd.cell);
	KUNIT_EXPECT_EQ(test, late.went, 4);
	dd_cell_leave(&cells, &late.cell);
	KUNIT_EXPECT_TRUE(test, dd_cells_empty(&cells));
}

static struct kunit_case dd_cell_cases[] = {
	KUNIT_CASE(dd_cell_test_disjoint_go_at_once),
	KUNIT_CASE(dd_cell_test_overlap_in_entry_order),
	KUNIT_CASE(dd_cell_test_turn_before_arm),
	KUNIT_CASE(dd_cell_test_early_leave_spares_earlier),
	KUNIT_CASE(dd_cell_test_chain_on_one_block),
	KUNIT_CASE(dd_cell_test_read_behind_write),
	{}
};

static struct kunit_suite dd_cell_suite = {
	.name = "dm_dedup_cell",
	.test_cases = dd_cell_cases,
};

kunit_test_suite(dd_cell_suite);
