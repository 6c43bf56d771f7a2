// SPDX-License-Identifier: GPL-2.0-only
/*
 * Logical block cells: see dedup-cell.h. The cells in flight are kept in
 * an interval tree by logical block, so entering and leaving cost a
 * lookup of the overlapping ones, not a walk of all.
 */
#include <linux/interval_tree_generic.h>

#include "dedup-cell.h"

#define DD_CELL_FIRST(c)	((c)->first)
#define DD_CELL_LAST(c)		((c)->last)

INTERVAL_TREE_DEFINE(struct dd_cell, rb, u64, subtree_last, DD_CELL_FIRST,
		     DD_CELL_LAST, static, dd_cell_tree)

void dd_cells_init(struct dd_cells *cells)
{
	spin_lock_init(&cells->lock);
	cells->tree = RB_ROOT_CACHED;
	cells->next_seq = 0;
	cells->waits = 0;
}

/*
 * Enter a change to logical blocks [@begin, @end). It may go ahead once
 * its owner calls dd_cell_arm() and every overlapping change entered
 * before it has left; if the arm comes first, @ready is called then.
 */
void dd_cell_enter(struct dd_cells *cells, struct dd_cell *cell, u64 begin,
		   u64 end, dd_cell_ready_fn ready)
{
	struct dd_cell *c;
	unsigned long flags;

	cell->first = begin;
	cell->last = end - 1;
	cell->ready = ready;
	cell->gate = 1;
	spin_lock_irqsave(&cells->lock, flags);
	cell->seq = cells->next_seq++;
	for (c = dd_cell_tree_iter_first(&cells->tree, cell->first, cell->last);
	     c; c = dd_cell_tree_iter_next(c, cell->first, cell->last))
		cell->gate++;
	if (cell->gate > 1)
		cells->waits++;
	dd_cell_tree_insert(cell, &cells->tree);
	spin_unlock_irqrestore(&cells->lock, flags);
}

/*
 * For a reader of logical blocks [@begin, @end), ready at once: if a
 * change to one of them is in flight, enter behind the overlapping ones
 * and return true; @ready is called when the last of them leaves. False:
 * nothing overlaps, and nothing was entered.
 */
bool dd_cell_enter_behind(struct dd_cells *cells, struct dd_cell *cell,
			  u64 begin, u64 end, dd_cell_ready_fn ready)
{
	struct dd_cell *c;
	unsigned long flags;
	bool behind;

	cell->first = begin;
	cell->last = end - 1;
	cell->ready = ready;
	cell->gate = 0;
	spin_lock_irqsave(&cells->lock, flags);
	for (c = dd_cell_tree_iter_first(&cells->tree, cell->first, cell->last);
	     c; c = dd_cell_tree_iter_next(c, cell->first, cell->last))
		cell->gate++;
	/* Once in the tree, the cell is its ready function's. */
	behind = cell->gate;
	if (behind) {
		cell->seq = cells->next_seq++;
		cells->waits++;
		dd_cell_tree_insert(cell, &cells->tree);
	}
	spin_unlock_irqrestore(&cells->lock, flags);
	return behind;
}

/*
 * The owner is ready to go ahead. True: go now; false: the cell's ready
 * function runs when the last earlier overlapping change leaves.
 */
bool dd_cell_arm(struct dd_cells *cells, struct dd_cell *cell)
{
	unsigned long flags;
	bool go;

	spin_lock_irqsave(&cells->lock, flags);
	go = !--cell->gate;
	spin_unlock_irqrestore(&cells->lock, flags);
	return go;
}

/*
 * The change is done: later overlapping changes no longer wait for it.
 * Earlier ones left before this one went ahead, except after a failure
 * that ends a change before its turn; they are skipped by order of entry.
 */
void dd_cell_leave(struct dd_cells *cells, struct dd_cell *cell)
{
	struct dd_cell *c;
	unsigned long flags;

	spin_lock_irqsave(&cells->lock, flags);
	dd_cell_tree_remove(cell, &cells->tree);
	for (c = dd_cell_tree_iter_first(&cells->tree, cell->first, cell->last);
	     c; c = dd_cell_tree_iter_next(c, cell->first, cell->last)) {
		if (c->seq > cell->seq && !--c->gate)
			c->ready(c);
	}
	spin_unlock_irqrestore(&cells->lock, flags);
}

/* Is a change to one of logical blocks [@begin, @end) in flight? */
bool dd_cells_busy(struct dd_cells *cells, u64 begin, u64 end)
{
	unsigned long flags;
	bool busy;

	spin_lock_irqsave(&cells->lock, flags);
	busy = dd_cell_tree_iter_first(&cells->tree, begin, end - 1);
	spin_unlock_irqrestore(&cells->lock, flags);
	return busy;
}

bool dd_cells_empty(struct dd_cells *cells)
{
	unsigned long flags;
	bool empty;

	spin_lock_irqsave(&cells->lock, flags);
	empty = RB_EMPTY_ROOT(&cells->tree.rb_root);
	spin_unlock_irqrestore(&cells->lock, flags);
	return empty;
}
