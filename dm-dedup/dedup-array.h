/* SPDX-License-Identifier: GPL-2.0-only */
/*
 * Persistent array of fixed-size entries: a radix tree of metadata blocks
 * with fixed fan-out and fixed height, so no rebalancing is ever needed.
 * Absent subtrees (child pointer 0) read as zero entries.
 */
#ifndef DM_DEDUP_ARRAY_H
#define DM_DEDUP_ARRAY_H

#include "dedup-block.h"

/*
 * Entries of leaves the running transaction wrote change in place while
 * other CPUs read them, each 64-bit word read and written whole
 * (READ_ONCE, WRITE_ONCE): a 32-bit kernel would tear them.
 */
#if BITS_PER_LONG != 64
#error "dm-dedup needs a 64-bit kernel"
#endif

struct dd_array {
	struct dd_bm *bm;
	u64 root;		/* block number of the root, 0 = empty */
	u64 nr_entries;
	u32 entry_size;
	u32 per_leaf;		/* entries in one leaf block */
	u8 height;		/* interior levels above the leaves */
	u8 id;			/* enum dd_array_id */
};

typedef int (*dd_leaf_fn)(void *ctx, u64 first_index, const void *entries,
			  u32 count);

void dd_array_init(struct dd_array *a, struct dd_bm *bm, u8 id,
		   u32 entry_size, u64 nr_entries, u64 root);
u64 dd_array_max_blocks(u32 entry_size, u64 nr_entries);
/*
 * To @nr_entries, at least the current count; new entries read as zero.
 * @leaf_buf: room for one leaf's entries. -EILSEQ when the old last
 * leaf has non-zero entries past the old end, which growing would expose.
 */
int dd_array_grow(struct dd_array *a, u64 nr_entries, void *leaf_buf);

int dd_array_lookup(struct dd_array *a, u64 index, void *entry, bool nowait);
int dd_array_update(struct dd_array *a, u64 index, struct dd_block *leaf,
		    void **entry);
int dd_array_fresh_entry(struct dd_array *a, u64 index, struct dd_block *leaf,
			 void **entry);
int dd_array_read_leaf(struct dd_array *a, u64 leaf_nr, void *entries);
/*
 * The indices in leaf @leaf_nr whose entry equals @value, at most @max of
 * them, into @out: returns how many (an absent leaf holds none). The leaf
 * stays held in @leaf (->buf NULL when nothing is held: an absent leaf,
 * or an error), so that the caller can look at the entries found again,
 * through dd_array_held_entry(), before it releases it with
 * dd_bm_release().
 */
int dd_array_find_held(struct dd_array *a, u64 leaf_nr, const void *value,
		       u64 *out, unsigned int max, struct dd_block *leaf);
/* Entry @index, which lies in @leaf. */
void *dd_array_held_entry(struct dd_array *a, struct dd_block *leaf,
			  u64 index);
int dd_array_next_leaf(struct dd_array *a, u64 *leaf_nr, u64 end_leaf);
int dd_array_walk(struct dd_array *a, dd_leaf_fn fn, void *ctx);

#endif
