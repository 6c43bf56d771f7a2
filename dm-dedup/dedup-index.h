/* SPDX-License-Identifier: GPL-2.0-only */
/*
 * In-memory fingerprint index: fingerprint -> physical block, rebuilt from
 * the persistent fingerprint records at activation.
 *
 * One flat array of 64-bit slots with open addressing (Robin Hood linear
 * probing, backward-shift deletion). A slot keeps the physical block, its
 * distance from its home slot and 16 more bits of the fingerprint; the home
 * slot itself encodes the first bits. A match is only a candidate: the
 * caller compares the full persistent fingerprint.
 */
#ifndef DM_DEDUP_INDEX_H
#define DM_DEDUP_INDEX_H

#include <linux/siphash.h>
#include <linux/types.h>

#include "dedup-format.h"

#define DD_INDEX_MAX_PBA	((1ULL << 40) - 2)

struct dd_index {
	u64 *slots;
	u64 nr_slots;
	u64 nr_entries;
	u64 max_entries;
	/*
	 * Placement is keyed, new at every activation: whoever can choose
	 * content must not be able to predict where it lands, or they could
	 * crowd one probe window until chosen content is never deduplicated.
	 */
	siphash_key_t key;
};

struct dd_index_iter {
	u64 pos;
	u32 dist;
	u16 tag;
};

int dd_index_init(struct dd_index *idx, u64 max_entries);
void dd_index_exit(struct dd_index *idx);
size_t dd_index_bytes(const struct dd_index *idx);

int dd_index_insert(struct dd_index *idx, const u8 *fp, u64 pba);
bool dd_index_slot_block(u64 slot, u64 *pba);
bool dd_index_remove(struct dd_index *idx, const u8 *fp, u64 pba);
void dd_index_iter_init(const struct dd_index *idx, const u8 *fp,
			struct dd_index_iter *it);
bool dd_index_iter_next(const struct dd_index *idx, struct dd_index_iter *it,
			u64 *pba);

#endif
