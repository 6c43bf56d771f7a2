// SPDX-License-Identifier: GPL-2.0-only
/*
 * Allocator with transaction-deferred frees; see dedup-space.h.
 */
#include <linux/bitmap.h>
#include <linux/bitops.h>
#include <linux/errno.h>
#include <linux/slab.h>

#include "dedup-space.h"

static unsigned long *bitmap_kvzalloc(u64 nr_bits)
{
	return kvcalloc(BITS_TO_LONGS(nr_bits), sizeof(unsigned long),
			GFP_KERNEL);
}

int dd_space_init(struct dd_space *s, u64 nr_blocks, u64 first)
{
	memset(s, 0, sizeof(*s));
	if (first > nr_blocks)
		return -EINVAL;
	s->used = bitmap_kvzalloc(nr_blocks);
	s->pending = bitmap_kvzalloc(nr_blocks);
	if (!s->used || !s->pending) {
		dd_space_exit(s);
		return -ENOMEM;
	}
	s->nr_blocks = nr_blocks;
	s->first = first;
	s->cursor = first;
	/* The reserved head counts as used so that free space is honest. */
	bitmap_set(s->used, 0, first);
	s->nr_used = first;
	return 0;
}

void dd_space_exit(struct dd_space *s)
{
	kvfree(s->used);
	kvfree(s->pending);
	kvfree(s->cooling);
	kvfree(s->held);
	s->used = NULL;
	s->pending = NULL;
	s->cooling = NULL;
	s->held = NULL;
}

size_t dd_space_bytes(const struct dd_space *s)
{
	size_t one = BITS_TO_LONGS(s->nr_blocks) * sizeof(unsigned long);

	return one * (!!s->used + !!s->pending + !!s->cooling + !!s->held);
}

/* From now on a free waits one more commit; see dedup-space.h. */
int dd_space_cool_frees(struct dd_space *s)
{
	s->cooling = bitmap_kvzalloc(s->nr_blocks);
	return s->cooling ? 0 : -ENOMEM;
}

/* From now on a commit holds the frees; see dedup-space.h. */
int dd_space_hold_frees(struct dd_space *s)
{
	s->held = bitmap_kvzalloc(s->nr_blocks);
	return s->held ? 0 : -ENOMEM;
}

/* The first run [*begin, *end) of held blocks at or after @from. */
bool dd_space_held_run(const struct dd_space *s, u64 from, u64 *begin,
		       u64 *end)
{
	if (!s->nr_held)
		return false;
	*begin = find_next_bit(s->held, s->nr_blocks, from);
	if (*begin >= s->nr_blocks)
		return false;
	*end = find_next_zero_bit(s->held, s->nr_blocks, *begin);
	return true;
}

/* Held blocks [begin, end) were discarded: they become free. */
void dd_space_release_held(struct dd_space *s, u64 begin, u64 end)
{
	bitmap_clear(s->held, begin, end - begin);
	bitmap_clear(s->used, begin, end - begin);
	s->nr_held -= end - begin;
	s->nr_used -= end - begin;
}

/*
 * Up to @want consecutive free blocks, from the next free one at or after
 * the cursor: the unique blocks of one write go out as one data bio.
 * A run stops at the first used block or the end of the device; the
 * caller asks again for the rest.
 */
int dd_space_alloc_run(struct dd_space *s, u64 want, u64 *first, u64 *len)
{
	unsigned long b, e;
	u64 limit;

	if (!want || !dd_space_free_blocks(s))
		return -ENOSPC;
	b = find_next_zero_bit(s->used, s->nr_blocks, s->cursor);
	if (b >= s->nr_blocks)
		b = find_next_zero_bit(s->used, s->nr_blocks, s->first);
	if (b >= s->nr_blocks)
		return -ENOSPC;	/* counters disagree with the bitmap */
	limit = min_t(u64, s->nr_blocks, b + want);
	e = find_next_bit(s->used, limit, b);
	bitmap_set(s->used, b, e - b);
	s->nr_used += e - b;
	s->cursor = e < s->nr_blocks ? e : s->first;
	*first = b;
	*len = e - b;
	return 0;
}

int dd_space_alloc(struct dd_space *s, u64 *block)
{
	u64 len;

	return dd_space_alloc_run(s, 1, block, &len);
}

/*
 * Exactly @len consecutive free blocks, searched from the start: for a
 * run that lives as long as the device (the journal). -ENOSPC if none.
 */
int dd_space_alloc_exact(struct dd_space *s, u64 len, u64 *first)
{
	unsigned long b = s->first, e;

	while (len && b + len <= s->nr_blocks) {
		b = find_next_zero_bit(s->used, s->nr_blocks, b);
		if (b + len > s->nr_blocks)
			break;
		e = find_next_bit(s->used, b + len, b);
		if (e == b + len) {
			bitmap_set(s->used, b, len);
			s->nr_used += len;
			*first = b;
			return 0;
		}
		b = e;
	}
	return -ENOSPC;
}

/* Activation: rebuild the allocation state from what the trees reference. */
int dd_space_mark_used(struct dd_space *s, u64 block)
{
	if (block < s->first || block >= s->nr_blocks)
		return -ERANGE;
	if (__test_and_set_bit(block, s->used))
		return -EEXIST;
	s->nr_used++;
	return 0;
}

void dd_space_release(struct dd_space *s, u64 block)
{
	if (WARN_ON_ONCE(!dd_space_is_used(s, block) || block < s->first))
		return;
	if (!__test_and_set_bit(block, s->pending))
		s->nr_pending++;
}

/*
 * For a block that no committed state and no reader can have seen, e.g.
 * the target of a unique write that failed.
 */
void dd_space_free_now(struct dd_space *s, u64 block)
{
	if (WARN_ON_ONCE(!dd_space_is_used(s, block) || block < s->first))
		return;
	if (test_bit(block, s->pending))
		return;	/* already on its way out */
	/* Referenced by the commit before the last: never handed out. */
	if (WARN_ON_ONCE(s->cooling && test_bit(block, s->cooling)))
		return;
	__clear_bit(block, s->used);
	s->nr_used--;
}

/* Blocks [b, e) are no longer referenced by any state a load may use. */
static void dd_space_reusable(struct dd_space *s, unsigned long b,
			      unsigned long e,
			      void (*freed)(void *ctx, u64 begin, u64 end),
			      void *ctx)
{
	if (s->held) {
		bitmap_set(s->held, b, e - b);
		s->nr_held += e - b;
		return;
	}
	bitmap_clear(s->used, b, e - b);
	s->nr_used -= e - b;
	if (freed)
		freed(ctx, b, e);
}

/*
 * The transaction is on disk. Frees it made become free (or held, if
 * the allocator holds them) unless the allocator cools them: then the
 * frees of the transaction before it do, and its own cool until the next
 * commit. @freed, if given, receives each run [begin, end) of blocks that
 * just became free.
 */
void dd_space_commit(struct dd_space *s,
		     void (*freed)(void *ctx, u64 begin, u64 end), void *ctx)
{
	unsigned long *ready = s->cooling ? s->cooling : s->pending;
	unsigned long b, e;

	if (!s->nr_pending && !s->nr_cooling)
		return;
	for (b = find_first_bit(ready, s->nr_blocks); b < s->nr_blocks;
	     b = find_next_bit(ready, s->nr_blocks, e)) {
		e = find_next_zero_bit(ready, s->nr_blocks, b);
		bitmap_clear(ready, b, e - b);
		dd_space_reusable(s, b, e, freed, ctx);
	}
	if (s->cooling) {
		/* Now all clear: the pending map becomes the cooling one. */
		s->cooling = s->pending;
		s->pending = ready;
		s->nr_cooling = s->nr_pending;
	}
	s->nr_pending = 0;
}

/*
 * Word @k of the blocks the last commit references, as saved at a clean
 * close: bit i is block 64k + i. Blocks on their way out (pending,
 * cooling, held) are not referenced, and the reserved head is implied.
 */
u64 dd_space_committed_word(const struct dd_space *s, u64 k)
{
	u64 first = k * 64, w = 0;
	unsigned long i, n, x;

	if (first >= s->nr_blocks)
		return 0;
	/* Whole longs at a time: the save runs over every block. */
	for (i = 0; i < 64 / BITS_PER_LONG; i++) {
		n = BIT_WORD(first) + i;
		if (n >= BITS_TO_LONGS(s->nr_blocks))
			break;
		x = s->used[n] & ~s->pending[n];
		if (s->cooling)
			x &= ~s->cooling[n];
		if (s->held)
			x &= ~s->held[n];
		w |= (u64)x << (i * BITS_PER_LONG);
	}
	/* The reserved head is implied, not saved; bits past the end are 0. */
	if (first < s->first)
		w &= s->first - first >= 64 ? 0 : ~0ULL << (s->first - first);
	return w;
}

/*
 * Activation from a saved state: the blocks of word @k (as
 * dd_space_committed_word made it) are taken. -EEXIST when one already
 * is, -ERANGE when one lies outside the range handed out.
 */
int dd_space_load_word(struct dd_space *s, u64 k, u64 bits)
{
	unsigned int i;
	int r;

	if (bits && k > (U64_MAX >> 6) - 1)
		return -ERANGE;
	while (bits) {
		i = __ffs64(bits);
		bits &= bits - 1;
		r = dd_space_mark_used(s, k * 64 + i);
		if (r)
			return r;
	}
	return 0;
}

/*
 * Every block taken so far leaves at the next commit: at activation from
 * a saved state, the blocks of the save itself, which only the loaded
 * superblock references.
 */
void dd_space_release_all(struct dd_space *s)
{
	unsigned long b;

	for (b = find_next_bit(s->used, s->nr_blocks, s->first);
	     b < s->nr_blocks; b = find_next_bit(s->used, s->nr_blocks, b + 1))
		dd_space_release(s, b);
}

/* Back to nothing taken, as after dd_space_init: a load that failed. */
void dd_space_reset(struct dd_space *s)
{
	size_t bytes = BITS_TO_LONGS(s->nr_blocks) * sizeof(unsigned long);

	memset(s->used, 0, bytes);
	memset(s->pending, 0, bytes);
	if (s->cooling)
		memset(s->cooling, 0, bytes);
	if (s->held)
		memset(s->held, 0, bytes);
	s->nr_pending = 0;
	s->nr_cooling = 0;
	s->nr_held = 0;
	s->cursor = s->first;
	bitmap_set(s->used, 0, s->first);
	s->nr_used = s->first;
}
