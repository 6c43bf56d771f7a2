// SPDX-License-Identifier: GPL-2.0-only
/*
 * In-memory fingerprint index; see dedup-index.h.
 */
#include <linux/errno.h>
#include <linux/math64.h>
#include <linux/slab.h>
#include <linux/unaligned.h>
#include <linux/vmalloc.h>
#include <linux/random.h>

#include "dedup-index.h"

/* slot: bits 0-39 PBA + 1 (0 = empty), 40-47 probe distance, 48-63 tag */
#define DD_SLOT_PBA_BITS	40
#define DD_SLOT_DIST_SHIFT	40
#define DD_SLOT_TAG_SHIFT	48
#define DD_MAX_DIST		255U

static inline u64 dd_slot_pba1(u64 s)
{
	return s & ((1ULL << DD_SLOT_PBA_BITS) - 1);
}

static inline u32 dd_slot_dist(u64 s)
{
	return (s >> DD_SLOT_DIST_SHIFT) & DD_MAX_DIST;
}

static inline u16 dd_slot_tag(u64 s)
{
	return s >> DD_SLOT_TAG_SHIFT;
}

static inline u64 dd_make_slot(u64 pba, u32 dist, u16 tag)
{
	return (pba + 1) | ((u64)dist << DD_SLOT_DIST_SHIFT) |
	       ((u64)tag << DD_SLOT_TAG_SHIFT);
}

/*
 * Slot and tag come from a keyed mix of the whole fingerprint: a short
 * digest (crc32c with verify) would otherwise leave the bits they use
 * constant, and an unkeyed one would let placement be chosen.
 */
static inline u64 dd_mix(const struct dd_index *idx, const u8 *fp)
{
	return siphash(fp, DD_FP_SIZE, &idx->key);
}

static inline u64 dd_home(const struct dd_index *idx, u64 mix)
{
	return mul_u64_u64_shr(mix, idx->nr_slots, 64);
}

static inline u16 dd_tag(u64 mix)
{
	return (u16)mix;
}

static inline u64 dd_next(const struct dd_index *idx, u64 pos)
{
	return pos + 1 < idx->nr_slots ? pos + 1 : 0;
}

/* The physical block a slot names, as saved and loaded: false if empty. */
bool dd_index_slot_block(u64 slot, u64 *pba)
{
	if (!dd_slot_pba1(slot))
		return false;
	*pba = dd_slot_pba1(slot) - 1;
	return true;
}

int dd_index_init(struct dd_index *idx, u64 max_entries)
{
	/* A load factor of at most 0.8 keeps probe sequences short. */
	idx->nr_slots = max_entries + max_entries / 4 + 16;
	idx->max_entries = max_entries;
	idx->nr_entries = 0;
	get_random_bytes(&idx->key, sizeof(idx->key));
	idx->slots = vzalloc(array_size(idx->nr_slots, sizeof(u64)));
	return idx->slots ? 0 : -ENOMEM;
}

void dd_index_exit(struct dd_index *idx)
{
	vfree(idx->slots);
	idx->slots = NULL;
}

size_t dd_index_bytes(const struct dd_index *idx)
{
	return idx->nr_slots * sizeof(u64);
}

/*
 * Where the insertion would end, without changing anything: Robin Hood
 * keeps distances tiny at this load, but a slot cannot record more than
 * DD_MAX_DIST and a half-done insertion cannot be undone.
 */
static bool dd_insert_fits(const struct dd_index *idx, u64 pos)
{
	u32 dist = 0;
	u64 s;

	for (;;) {
		s = idx->slots[pos];
		if (!s)
			return true;
		if (dd_slot_dist(s) < dist)
			dist = dd_slot_dist(s);
		if (dist == DD_MAX_DIST)
			return false;
		dist++;
		pos = dd_next(idx, pos);
	}
}

int dd_index_insert(struct dd_index *idx, const u8 *fp, u64 pba)
{
	u64 mix = dd_mix(idx, fp), pos = dd_home(idx, mix), cur, s;

	if (pba > DD_INDEX_MAX_PBA)
		return -ERANGE;
	if (idx->nr_entries >= idx->max_entries || !dd_insert_fits(idx, pos))
		return -ENOSPC;
	cur = dd_make_slot(pba, 0, dd_tag(mix));
	for (;;) {
		s = idx->slots[pos];
		if (!s) {
			idx->slots[pos] = cur;
			idx->nr_entries++;
			return 0;
		}
		if (dd_slot_dist(s) < dd_slot_dist(cur)) {
			idx->slots[pos] = cur;
			cur = s;
		}
		cur += 1ULL << DD_SLOT_DIST_SHIFT;
		pos = dd_next(idx, pos);
	}
}

void dd_index_iter_init(const struct dd_index *idx, const u8 *fp,
			struct dd_index_iter *it)
{
	u64 mix = dd_mix(idx, fp);

	it->pos = dd_home(idx, mix);
	it->dist = 0;
	it->tag = dd_tag(mix);
}

/* Next physical block whose fingerprint may equal the iterator's. */
bool dd_index_iter_next(const struct dd_index *idx, struct dd_index_iter *it,
			u64 *pba)
{
	u64 s;

	for (;;) {
		s = idx->slots[it->pos];
		/* Robin Hood: nobody from our home sits beyond a closer one. */
		if (!s || dd_slot_dist(s) < it->dist)
			return false;
		it->pos = dd_next(idx, it->pos);
		it->dist++;
		if (dd_slot_dist(s) == it->dist - 1 && dd_slot_tag(s) == it->tag) {
			*pba = dd_slot_pba1(s) - 1;
			return true;
		}
	}
}

bool dd_index_remove(struct dd_index *idx, const u8 *fp, u64 pba)
{
	struct dd_index_iter it;
	u64 found, pos, next, s;

	dd_index_iter_init(idx, fp, &it);
	while (dd_index_iter_next(idx, &it, &found)) {
		if (found != pba)
			continue;
		/* The iterator stands one past the slot it returned. */
		pos = it.pos ? it.pos - 1 : idx->nr_slots - 1;
		for (next = dd_next(idx, pos);; next = dd_next(idx, next)) {
			s = idx->slots[next];
			if (!s || !dd_slot_dist(s))
				break;
			idx->slots[pos] = s - (1ULL << DD_SLOT_DIST_SHIFT);
			pos = next;
		}
		idx->slots[pos] = 0;
		idx->nr_entries--;
		return true;
	}
	return false;
}
