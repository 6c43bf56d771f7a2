/* SPDX-License-Identifier: GPL-2.0-only */
/*
 * In-memory allocator for a range of blocks (physical data blocks or
 * metadata blocks).
 *
 * A block given up during a transaction may still be referenced by the
 * last committed state, so it stays allocated ("pending free") until the
 * transaction commits. That is what makes a crash land on either the old
 * or the new content of a block, never on somebody else's.
 *
 * An allocator that cools frees (dd_space_cool_frees) keeps them one
 * commit longer ("cooling"): a block freed in transaction T is reused
 * only after T + 1 has committed. Until then the superblock slot that T
 * did not overwrite still describes T - 1, which may reference the block;
 * should T's slot be damaged later on the medium, the device falls back
 * to T - 1 and must find the block's content unchanged. Data blocks cool;
 * metadata blocks need not, because every metadata block names the
 * transaction that wrote it, so a reused one is refused, never misread.
 *
 * An allocator that holds frees (dd_space_hold_frees) keeps them
 * allocated past the commit too, "held", until its owner has discarded
 * them on the device and releases them: a discard still in flight must
 * never land on a block written again.
 */
#ifndef DM_DEDUP_SPACE_H
#define DM_DEDUP_SPACE_H

#include <linux/bitops.h>
#include <linux/minmax.h>
#include <linux/types.h>

struct dd_space {
	unsigned long *used;	/* allocated, or pending free */
	unsigned long *pending;	/* released in the running transaction */
	unsigned long *cooling;	/* released in the last committed one, or NULL */
	unsigned long *held;	/* committed frees not released yet, or NULL */
	u64 nr_blocks;
	u64 nr_used;		/* includes pending, cooling and held */
	u64 nr_pending;
	u64 nr_cooling;
	u64 nr_held;
	u64 cursor;		/* next-fit start, keeps writes sequential */
	u64 first;		/* blocks below this are never handed out */
};

int dd_space_init(struct dd_space *s, u64 nr_blocks, u64 first);
/* RAM its bitmaps take. */
size_t dd_space_bytes(const struct dd_space *s);
void dd_space_exit(struct dd_space *s);

int dd_space_alloc(struct dd_space *s, u64 *block);
int dd_space_alloc_run(struct dd_space *s, u64 want, u64 *first, u64 *len);
int dd_space_alloc_exact(struct dd_space *s, u64 len, u64 *first);
int dd_space_mark_used(struct dd_space *s, u64 block);
void dd_space_release(struct dd_space *s, u64 block);
void dd_space_free_now(struct dd_space *s, u64 block);
void dd_space_commit(struct dd_space *s,
		     void (*freed)(void *ctx, u64 begin, u64 end), void *ctx);
int dd_space_cool_frees(struct dd_space *s);
int dd_space_hold_frees(struct dd_space *s);
bool dd_space_held_run(const struct dd_space *s, u64 from, u64 *begin,
		       u64 *end);
void dd_space_release_held(struct dd_space *s, u64 begin, u64 end);
u64 dd_space_committed_word(const struct dd_space *s, u64 k);
int dd_space_load_word(struct dd_space *s, u64 k, u64 bits);
void dd_space_release_all(struct dd_space *s);
void dd_space_reset(struct dd_space *s);

static inline u64 dd_space_free_blocks(const struct dd_space *s)
{
	return s->nr_blocks - s->nr_used;
}

/* Blocks that come back free at a later commit (or discard). */
static inline u64 dd_space_frees_to_come(const struct dd_space *s)
{
	return s->nr_pending + s->nr_cooling + s->nr_held;
}

static inline bool dd_space_is_used(const struct dd_space *s, u64 block)
{
	return block < s->nr_blocks && test_bit(block, s->used);
}

/* Released in the running transaction: used until the next commit. */
static inline bool dd_space_is_pending(const struct dd_space *s, u64 block)
{
	return dd_space_is_used(s, block) && test_bit(block, s->pending);
}

/* Is any block of [@first, @end) in use? */
static inline bool dd_space_any_used(const struct dd_space *s, u64 first,
				     u64 end)
{
	end = min(end, s->nr_blocks);
	return first < end && find_next_bit(s->used, end, first) < end;
}

#endif
