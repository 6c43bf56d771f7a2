// SPDX-License-Identifier: GPL-2.0-only
/*
 * In-memory fingerprint index; see dedup-index.h.
 */
#include <linux/bits.h>
#include <linux/bitops.h>
#include <linux/errno.h>
#include <linux/math64.h>
#include <linux/minmax.h>
#include <linux/random.h>
#include <linux/slab.h>
#include <linux/vmalloc.h>

#include "dedup-index.h"

/*
 * Slots for every data block at this load, when all hold unique content:
 * 30-bit entries at 95 % cost 3.95 bytes per data block. Eight-entry
 * cuckoo buckets fill to about 98 % before inserts fail; with tags as
 * short as DD_INDEX_MIN_TAG_BITS the partner buckets are few, and 95 %
 * is what still fills without a failure (measured, see dm-dedup.rst).
 */
#define DD_INDEX_LOAD_PERCENT	95
#define DD_INDEX_MIN_ENTRY_BITS	30
/* Below this, partners are too few to fill: entries grow instead. */
#define DD_INDEX_MIN_TAG_BITS	4
/* Entries moved, at most, to make room for one; then the insert fails. */
#define DD_INDEX_MAX_KICKS	1000

static inline u64 dd_entry_mask(const struct dd_index *idx)
{
	return GENMASK_ULL(idx->entry_bits - 1, 0);
}

static u64 dd_entry_get(const struct dd_index *idx, u64 k)
{
	u64 bit = k * idx->entry_bits, i = bit / 64, v;
	u32 off = bit % 64;

	v = idx->words[i] >> off;
	if (off + idx->entry_bits > 64)
		v |= idx->words[i + 1] << (64 - off);
	return v & dd_entry_mask(idx);
}

static void dd_entry_set(struct dd_index *idx, u64 k, u64 e)
{
	u64 bit = k * idx->entry_bits, i = bit / 64, m = dd_entry_mask(idx);
	u32 off = bit % 64;

	idx->words[i] = (idx->words[i] & ~(m << off)) | (e << off);
	if (off + idx->entry_bits > 64) {
		idx->words[i + 1] = (idx->words[i + 1] & ~(m >> (64 - off))) |
				    (e >> (64 - off));
	}
}

/* The leaf field: leaf + 1, or 0. */
static inline u64 dd_entry_leaf1(const struct dd_index *idx, u64 e)
{
	return e & GENMASK_ULL(idx->leaf_bits - 1, 0);
}

static inline u64 dd_entry_tag(const struct dd_index *idx, u64 e)
{
	return e >> idx->leaf_bits;
}

static inline u64 dd_make_entry(const struct dd_index *idx, u64 tag, u64 leaf)
{
	return (tag << idx->leaf_bits) | (leaf + 1);
}

/*
 * Home and tag come from a keyed mix of the whole fingerprint: a short
 * digest (crc32c with verify) would otherwise leave the bits they use
 * constant, and an unkeyed one would let placement be chosen.
 */
static void dd_place(const struct dd_index *idx, const u8 *fp, u64 *home,
		     u64 *tag)
{
	u64 mix = siphash(fp, DD_FP_SIZE, &idx->key);

	*home = mul_u64_u64_shr(mix, idx->nr_buckets, 64);
	*tag = mix & GENMASK_ULL(idx->entry_bits - idx->leaf_bits - 1, 0);
}

/* Swaps @b with b ^ @m when both are buckets: an involution. */
static u64 dd_swap_bits(const struct dd_index *idx, u64 b, u64 m)
{
	u64 x = b ^ m;

	return x < idx->nr_buckets ? x : b;
}

/*
 * The other bucket of an entry in bucket @b, from the tag alone: s(c -
 * s(b)) with c and the bit swap s drawn from the tag. It is an involution
 * (s and b -> c - b are), so the partner's partner is @b again, and two
 * entries with one tag that share one bucket share both.
 *
 * c - b alone would do that too, but short tags give few partners and
 * those maps commute: a full bucket's entries could then only move along
 * a few fixed strides, and 16-way tags failed 0.07 % of inserts into 64M
 * entries at the design load. Mixing in the bit swap breaks that
 * symmetry (no failure in the same run).
 */
static u64 dd_partner(const struct dd_index *idx, u64 b, u64 tag)
{
	u64 h = (tag + 1) * 0x9E3779B97F4A7C15ULL;
	u64 c = mul_u64_u64_shr(h, idx->nr_buckets, 64);
	u64 m = (h ^ (h >> 29)) * 0xBF58476D1CE4E5B9ULL;

	m &= GENMASK_ULL(fls64(idx->nr_buckets) - 1, 0);
	b = dd_swap_bits(idx, b, m);
	b = c >= b ? c - b : c + idx->nr_buckets - b;
	return dd_swap_bits(idx, b, m);
}

/* The sizes, from the number of data blocks alone. */
static void dd_index_size(struct dd_index *idx, u64 max_entries)
{
	u64 slots;

	memset(idx, 0, sizeof(*idx));
	idx->max_entries = max_entries;
	idx->nr_leaves = DIV_ROUND_UP_ULL(max_entries, DD_FP_PER_LEAF);
	idx->leaf_bits = fls64(idx->nr_leaves) ?: 1;
	idx->entry_bits = max(DD_INDEX_MIN_ENTRY_BITS,
			      idx->leaf_bits + DD_INDEX_MIN_TAG_BITS);
	idx->nr_buckets = DIV_ROUND_UP_ULL(max_entries * 100,
					   DD_INDEX_LOAD_PERCENT * DD_INDEX_BUCKET);
	idx->nr_buckets = max_t(u64, 2, idx->nr_buckets);
	slots = idx->nr_buckets * DD_INDEX_BUCKET;
	idx->nr_words = DIV_ROUND_UP_ULL(slots * idx->entry_bits, 64);
}

u64 dd_index_bytes_for(u64 max_entries)
{
	struct dd_index idx;

	dd_index_size(&idx, max_entries);
	return dd_index_bytes(&idx);
}

int dd_index_init(struct dd_index *idx, u64 max_entries)
{
	dd_index_size(idx, max_entries);
	get_random_bytes(&idx->key, sizeof(idx->key));
	idx->rng = (u32)idx->key.key[0];
	idx->words = vzalloc(array_size(idx->nr_words, sizeof(u64)));
	return idx->words ? 0 : -ENOMEM;
}

void dd_index_exit(struct dd_index *idx)
{
	vfree(idx->words);
	idx->words = NULL;
}

size_t dd_index_bytes(const struct dd_index *idx)
{
	return idx->nr_words * sizeof(u64);
}

u64 dd_index_geometry(const struct dd_index *idx)
{
	return idx->entry_bits | (u64)idx->leaf_bits << 8 |
	       (u64)DD_INDEX_BUCKET << 16 | (u64)DD_FP_PER_LEAF << 32;
}

u64 dd_index_nr_slots(const struct dd_index *idx)
{
	return idx->nr_buckets * DD_INDEX_BUCKET;
}

int dd_index_slot_leaf(const struct dd_index *idx, u64 k, u64 *leaf)
{
	u64 e = dd_entry_get(idx, k), leaf1;

	if (!e)
		return 0;
	leaf1 = dd_entry_leaf1(idx, e);
	if (!leaf1 || leaf1 > idx->nr_leaves)
		return -EILSEQ;
	*leaf = leaf1 - 1;
	return 1;
}

/* Puts @e in a free slot of bucket @b, if it has one. */
static bool dd_bucket_put(struct dd_index *idx, u64 b, u64 e)
{
	u64 k = b * DD_INDEX_BUCKET, end = k + DD_INDEX_BUCKET;

	for (; k < end; k++) {
		if (!dd_entry_get(idx, k)) {
			dd_entry_set(idx, k, e);
			return true;
		}
	}
	return false;
}

/*
 * The slot a kick takes, from a linear congruential sequence: it runs
 * backwards too, so undoing a walk needs no record of the slots.
 */
#define DD_LCG_MUL	1664525U
#define DD_LCG_MUL_INV	0xfee058c5U	/* DD_LCG_MUL * this == 1 mod 2^32 */
#define DD_LCG_ADD	1013904223U

static unsigned int dd_kick_slot(u32 x)
{
	return (x >> 16) % DD_INDEX_BUCKET;
}

/*
 * Both buckets full: move entries to their partner buckets, each chosen
 * at random, until one lands in a free slot. A walk that finds none is
 * undone step by step (the partner relation runs both ways), so a failed
 * insert leaves the index as it was.
 */
static bool dd_index_kick(struct dd_index *idx, u64 b, u64 e)
{
	unsigned int n;
	u64 victim, k;

	for (n = 0; n < DD_INDEX_MAX_KICKS; n++) {
		idx->rng = idx->rng * DD_LCG_MUL + DD_LCG_ADD;
		k = b * DD_INDEX_BUCKET + dd_kick_slot(idx->rng);
		victim = dd_entry_get(idx, k);
		dd_entry_set(idx, k, e);
		e = victim;
		b = dd_partner(idx, b, dd_entry_tag(idx, e));
		if (dd_bucket_put(idx, b, e))
			return true;
	}
	while (n--) {
		b = dd_partner(idx, b, dd_entry_tag(idx, e));
		k = b * DD_INDEX_BUCKET + dd_kick_slot(idx->rng);
		victim = dd_entry_get(idx, k);
		dd_entry_set(idx, k, e);
		e = victim;
		idx->rng = (idx->rng - DD_LCG_ADD) * DD_LCG_MUL_INV;
	}
	return false;
}

int dd_index_insert(struct dd_index *idx, const u8 *fp, u64 pba)
{
	u64 leaf = dd_index_leaf_of(pba), home, tag, e;

	if (leaf >= idx->nr_leaves)
		return -ERANGE;
	if (idx->nr_entries >= idx->max_entries)
		return -ENOSPC;
	dd_place(idx, fp, &home, &tag);
	e = dd_make_entry(idx, tag, leaf);
	if (!dd_bucket_put(idx, home, e) &&
	    !dd_bucket_put(idx, dd_partner(idx, home, tag), e) &&
	    !dd_index_kick(idx, home, e))
		return -ENOSPC;
	idx->nr_entries++;
	return 0;
}

void dd_index_iter_init(const struct dd_index *idx, const u8 *fp,
			struct dd_index_iter *it)
{
	dd_place(idx, fp, &it->bucket[0], &it->tag);
	it->bucket[1] = dd_partner(idx, it->bucket[0], it->tag);
	it->pos = 0;
}

/* The slot the iterator looked at last. */
static u64 dd_iter_slot(const struct dd_index_iter *it)
{
	u32 pos = it->pos - 1;

	return it->bucket[pos / DD_INDEX_BUCKET] * DD_INDEX_BUCKET +
	       pos % DD_INDEX_BUCKET;
}

bool dd_index_iter_next(const struct dd_index *idx, struct dd_index_iter *it,
			u64 *leaf)
{
	u32 end = it->bucket[1] == it->bucket[0] ? DD_INDEX_BUCKET :
						   2 * DD_INDEX_BUCKET;
	u64 e;

	while (it->pos < end) {
		it->pos++;
		e = dd_entry_get(idx, dd_iter_slot(it));
		if (e && dd_entry_tag(idx, e) == it->tag) {
			*leaf = dd_entry_leaf1(idx, e) - 1;
			return true;
		}
	}
	return false;
}

/*
 * Entries are equal when tag and leaf are, and equal entries share both
 * buckets: whichever of them goes, the index answers as if it were the
 * one that belonged to @fp.
 */
bool dd_index_remove(struct dd_index *idx, const u8 *fp, u64 pba)
{
	u64 leaf = dd_index_leaf_of(pba), found;
	struct dd_index_iter it;

	dd_index_iter_init(idx, fp, &it);
	while (dd_index_iter_next(idx, &it, &found)) {
		if (found != leaf)
			continue;
		dd_entry_set(idx, dd_iter_slot(&it), 0);
		idx->nr_entries--;
		return true;
	}
	return false;
}
