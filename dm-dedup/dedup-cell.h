/* SPDX-License-Identifier: GPL-2.0-only */
/*
 * Logical block cells: in-flight changes to overlapping logical blocks
 * take effect in the order they were mapped (architecture D6).
 *
 * A write is decided only after hashing, and a new block is mapped only
 * when its data write completes, so without cells a duplicate submitted
 * after a unique write to the same block would be mapped first and then
 * overwritten by it. Each write, discard or write zeroes enters a cell
 * for its range when dm maps it; it goes ahead once every overlapping
 * change entered before it has left, and leaves when it completes. A
 * change never waits for a later one, so cells cannot deadlock, and a
 * change that overlaps nothing in flight pays one lock trip to enter and
 * one to leave.
 */
#ifndef DM_DEDUP_CELL_H
#define DM_DEDUP_CELL_H

#include <linux/rbtree.h>
#include <linux/spinlock.h>
#include <linux/types.h>

struct dd_cell;

/* Called when the cell may go ahead, under the cells' lock: queue work. */
typedef void (*dd_cell_ready_fn)(struct dd_cell *cell);

struct dd_cell {
	struct rb_node rb;
	u64 first, last;	/* logical blocks, inclusive */
	u64 subtree_last;	/* the interval tree's */
	u64 seq;		/* order of entry */
	/*
	 * Overlapping changes entered earlier and still in flight, plus one
	 * for the owner until it is ready itself (dd_cell_arm).
	 */
	unsigned int gate;
	dd_cell_ready_fn ready;
};

struct dd_cells {
	spinlock_t lock;	/* protects everything below and every cell */
	struct rb_root_cached tree;
	u64 next_seq;
	u64 waits;		/* cells that had to wait, for the stats */
};

void dd_cells_init(struct dd_cells *cells);
void dd_cell_enter(struct dd_cells *cells, struct dd_cell *cell, u64 begin,
		   u64 end, dd_cell_ready_fn ready);
bool dd_cell_arm(struct dd_cells *cells, struct dd_cell *cell);
bool dd_cell_enter_behind(struct dd_cells *cells, struct dd_cell *cell,
			  u64 begin, u64 end, dd_cell_ready_fn ready);
void dd_cell_leave(struct dd_cells *cells, struct dd_cell *cell);
bool dd_cells_busy(struct dd_cells *cells, u64 begin, u64 end);
bool dd_cells_empty(struct dd_cells *cells);

#endif
