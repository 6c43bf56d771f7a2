/* SPDX-License-Identifier: GPL-2.0-only */
/*
 * Per-CPU reservations of physical blocks.
 *
 * A write of a few new blocks takes them from its CPU's reserved run,
 * under that CPU's own lock; only the refill of a run goes through the
 * data allocator and its lock. Concurrent writers on different CPUs then
 * no longer meet at one lock for every 4 KiB block, and each CPU's new
 * blocks stay consecutive, so the data bios of its writes still merge.
 *
 * The blocks of a run are taken in the allocator (dd_space) for as long
 * as they are reserved. Their owner, dedup-metadata.c, counts them as
 * free and gives them back (dd_reserve_drain) before anything reads the
 * allocator as the state of the device (a save at a clean close) and
 * before it reports the device full.
 *
 * Locking: each CPU's run has its own spinlock, the innermost lock of
 * the target (dedup-target.h). It is taken alone to take blocks, and
 * under md->data_lock to fill or drain a run.
 */
#ifndef DM_DEDUP_RESERVE_H
#define DM_DEDUP_RESERVE_H

#include <linux/percpu.h>
#include <linux/spinlock.h>
#include <linux/types.h>

/* Blocks a run is refilled with; writes of more go to the allocator. */
#define DD_RESERVE_RUN		64
#define DD_RESERVE_MAX_WANT	(DD_RESERVE_RUN / 4)

struct dd_reserve_run {
	spinlock_t lock;	/* protects next and end */
	u64 next;	/* first block not handed out yet */
	u64 end;	/* next == end: empty */
};

struct dd_reserve {
	struct dd_reserve_run __percpu *runs;
};

int dd_reserve_init(struct dd_reserve *rs);
void dd_reserve_exit(struct dd_reserve *rs);
u64 dd_reserve_take(struct dd_reserve *rs, u64 want, u64 *first);
bool dd_reserve_fill(struct dd_reserve *rs, u64 first, u64 len);
bool dd_reserve_drain(struct dd_reserve *rs, u64 *first, u64 *len);

#endif
