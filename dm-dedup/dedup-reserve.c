// SPDX-License-Identifier: GPL-2.0-only
/*
 * Per-CPU reservations of physical blocks; see dedup-reserve.h.
 */
#include <linux/errno.h>
#include <linux/minmax.h>

#include "dedup-reserve.h"

int dd_reserve_init(struct dd_reserve *rs)
{
	int cpu;

	rs->runs = alloc_percpu(struct dd_reserve_run);
	if (!rs->runs)
		return -ENOMEM;
	for_each_possible_cpu(cpu)
		spin_lock_init(&per_cpu_ptr(rs->runs, cpu)->lock);
	return 0;
}

void dd_reserve_exit(struct dd_reserve *rs)
{
	free_percpu(rs->runs);
	rs->runs = NULL;
}

/*
 * Up to @want consecutive blocks from the run of the CPU we run on: how
 * many, from *@first; 0 when that run is empty. A writer moved to
 * another CPU meanwhile takes from the run it locked, which is as good.
 */
u64 dd_reserve_take(struct dd_reserve *rs, u64 want, u64 *first)
{
	struct dd_reserve_run *run = raw_cpu_ptr(rs->runs);
	u64 n;

	spin_lock(&run->lock);
	n = min(want, run->end - run->next);
	*first = run->next;
	run->next += n;
	spin_unlock(&run->lock);
	return n;
}

/*
 * The blocks [@first, @first + @len), taken in the allocator, become the
 * run of the CPU we run on, if that run is empty; false if it is not,
 * and the caller gives them back.
 */
bool dd_reserve_fill(struct dd_reserve *rs, u64 first, u64 len)
{
	struct dd_reserve_run *run = raw_cpu_ptr(rs->runs);
	bool empty;

	spin_lock(&run->lock);
	empty = run->next == run->end;
	if (empty) {
		run->next = first;
		run->end = first + len;
	}
	spin_unlock(&run->lock);
	return empty;
}

/*
 * Take the blocks left in one CPU's run, [*@first, *@first + *@len),
 * away from it; false when every run is empty.
 */
bool dd_reserve_drain(struct dd_reserve *rs, u64 *first, u64 *len)
{
	struct dd_reserve_run *run;
	int cpu;

	for_each_possible_cpu(cpu) {
		run = per_cpu_ptr(rs->runs, cpu);
		spin_lock(&run->lock);
		*first = run->next;
		*len = run->end - run->next;
		run->next = run->end;
		spin_unlock(&run->lock);
		if (*len)
			return true;
	}
	return false;
}
