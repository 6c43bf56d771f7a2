/* SPDX-License-Identifier: GPL-2.0-only */
/*
 * In-memory fingerprint index: fingerprint -> the fingerprint leaf that
 * holds its record, rebuilt from the persistent fingerprint records at
 * activation (or loaded from a clean close's save).
 *
 * Under 4 bytes per data block for full coverage, so an entry cannot hold
 * a physical block number: a data device of 2^32 blocks needs 32 bits
 * for that alone. An entry holds the number of the fingerprint-array leaf
 * that keeps the block's record (DD_FP_PER_LEAF blocks per leaf, about 7
 * bits fewer) and a short tag of a keyed hash of the fingerprint; the
 * caller reads that leaf, which a share reads anyway, and finds the block
 * by its full record. See Documentation/device-mapper/dm-dedup.rst
 * ("The fingerprint index") for the sizes and the false-candidate rate.
 *
 * Layout: a bucketed cuckoo table. An entry lives in one of two buckets
 * of DD_INDEX_BUCKET entries: its home, from the hash, or the home's
 * partner, computed from the home and the tag alone, so that an entry
 * can be moved to its other bucket without knowing its fingerprint.
 * Entries are packed at entry_bits each.
 */
#ifndef DM_DEDUP_INDEX_H
#define DM_DEDUP_INDEX_H

#include <linux/math64.h>
#include <linux/siphash.h>
#include <linux/types.h>

#include "dedup-format.h"

#define DD_INDEX_BUCKET		8	/* entries per bucket */
/* The largest physical block the target supports (2^40 - 1 blocks). */
#define DD_INDEX_MAX_PBA	((1ULL << 40) - 2)

struct dd_index {
	u64 *words;		/* the packed entries */
	u64 nr_words;
	u64 nr_buckets;
	u64 nr_leaves;		/* fingerprint leaves the data device has */
	u64 nr_entries;
	u64 max_entries;
	u8 entry_bits;
	u8 leaf_bits;		/* low bits of an entry: leaf + 1, 0 = empty */
	u32 rng;		/* picks the entry a full bucket gives up */
	/*
	 * Placement is keyed, new at every rebuild: whoever can choose
	 * content must not be able to predict where it lands, or they could
	 * fill one bucket pair until chosen content is never deduplicated.
	 */
	siphash_key_t key;
};

struct dd_index_iter {
	u64 bucket[2];
	u64 tag;
	u32 pos;		/* entries looked at, over both buckets */
};

int dd_index_init(struct dd_index *idx, u64 max_entries);
void dd_index_exit(struct dd_index *idx);
size_t dd_index_bytes(const struct dd_index *idx);
/* What dd_index_init(max_entries) would allocate. */
u64 dd_index_bytes_for(u64 max_entries);
/* What a save records of the layout: differs whenever the sizes do. */
u64 dd_index_geometry(const struct dd_index *idx);
u64 dd_index_nr_slots(const struct dd_index *idx);
/* Slot @k of a loaded index: 1 and *leaf, 0 if empty, -EILSEQ if malformed. */
int dd_index_slot_leaf(const struct dd_index *idx, u64 k, u64 *leaf);

static inline u64 dd_index_leaf_of(u64 pba)
{
	return div_u64(pba, DD_FP_PER_LEAF);
}

int dd_index_insert(struct dd_index *idx, const u8 *fp, u64 pba);
bool dd_index_remove(struct dd_index *idx, const u8 *fp, u64 pba);
void dd_index_iter_init(const struct dd_index *idx, const u8 *fp,
			struct dd_index_iter *it);
/* The next leaf that may hold @fp's record; a leaf may come twice. */
bool dd_index_iter_next(const struct dd_index *idx, struct dd_index_iter *it,
			u64 *leaf);

#endif
