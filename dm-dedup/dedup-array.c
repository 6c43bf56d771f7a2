// SPDX-License-Identifier: GPL-2.0-only
/*
 * Persistent copy-on-write array; see dedup-array.h.
 */
#define DM_MSG_PREFIX "dedup"

#include <linux/device-mapper.h>
#include <linux/math64.h>
#include <linux/unaligned.h>

#include "dedup-array.h"

static u32 dd_per_leaf(u32 entry_size)
{
	return DD_PAYLOAD_SIZE / entry_size;
}

static u64 dd_nr_leaves(u32 entry_size, u64 nr_entries)
{
	return div64_u64(nr_entries + dd_per_leaf(entry_size) - 1,
			 dd_per_leaf(entry_size));
}

void dd_array_init(struct dd_array *a, struct dd_bm *bm, u8 id,
		   u32 entry_size, u64 nr_entries, u64 root)
{
	u64 leaves = dd_nr_leaves(entry_size, nr_entries), reach = 1;

	a->bm = bm;
	a->id = id;
	a->entry_size = entry_size;
	a->per_leaf = dd_per_leaf(entry_size);
	a->nr_entries = nr_entries;
	a->root = root;
	a->height = 0;
	while (reach < leaves) {
		reach *= DD_INTERIOR_FANOUT;
		a->height++;
	}
}

/* Blocks a fully populated array occupies: sizes the metadata device. */
u64 dd_array_max_blocks(u32 entry_size, u64 nr_entries)
{
	u64 level = dd_nr_leaves(entry_size, nr_entries), total = level;

	while (level > 1) {
		level = div64_u64(level + DD_INTERIOR_FANOUT - 1,
				  DD_INTERIOR_FANOUT);
		total += level;
	}
	return total;
}

static void dd_kind(const struct dd_array *a, u8 level,
		    struct dd_block_kind *kind)
{
	kind->type = level ? DD_BT_INTERIOR : DD_BT_LEAF;
	kind->array = a->id;
	kind->level = level;
}

/* Which child of a node at @level leads to leaf @leaf_nr. */
static u32 dd_child_slot(u64 leaf_nr, u8 level)
{
	u8 i;

	for (i = 1; i < level; i++)
		leaf_nr = div_u64(leaf_nr, DD_INTERIOR_FANOUT);
	return do_div(leaf_nr, DD_INTERIOR_FANOUT);
}

static __le64 *dd_children(const struct dd_block *blk)
{
	return dd_payload(blk);
}

static int dd_read(struct dd_array *a, u64 nr, u8 level, bool nowait,
		   struct dd_block *blk)
{
	struct dd_block_kind kind;

	dd_kind(a, level, &kind);
	if (nowait)
		return dd_bm_read_cached(a->bm, nr, &kind, blk);
	return dd_bm_read(a->bm, nr, &kind, blk);
}

/* Block number of leaf @leaf_nr, 0 if absent. */
static int dd_find_leaf(struct dd_array *a, u64 leaf_nr, bool nowait, u64 *nr)
{
	struct dd_block blk;
	u64 b = a->root;
	u8 level;
	int r;

	for (level = a->height; level && b; level--) {
		r = dd_read(a, b, level, nowait, &blk);
		if (r)
			return r;
		b = le64_to_cpu(dd_children(&blk)[dd_child_slot(leaf_nr, level)]);
		dd_bm_release(&blk);
	}
	*nr = b;
	return 0;
}

/* Entry @slot of the held leaf @leaf. */
static void *dd_slot_entry(struct dd_array *a, struct dd_block *leaf, u32 slot)
{
	return (u8 *)dd_payload(leaf) + slot * a->entry_size;
}

/*
 * Hold the leaf of entry @index, with @entry pointing into it; *@entry is
 * NULL, and nothing held, when the leaf is absent. With @fresh, only a
 * leaf the running transaction wrote: -EAGAIN for any other.
 */
static int dd_hold_entry(struct dd_array *a, u64 index, bool nowait,
			 bool fresh, struct dd_block *leaf, void **entry)
{
	u64 leaf_nr, b;
	u32 slot;
	int r;

	if (index >= a->nr_entries)
		return -ERANGE;
	leaf_nr = div_u64_rem(index, a->per_leaf, &slot);
	r = dd_find_leaf(a, leaf_nr, nowait, &b);
	if (r)
		return r;
	if (fresh && (!b || !dd_bm_is_fresh(a->bm, b)))
		return -EAGAIN;
	*entry = NULL;
	if (!b)
		return 0;
	r = dd_read(a, b, 0, nowait, leaf);
	if (r)
		return r;
	*entry = dd_slot_entry(a, leaf, slot);
	return 0;
}

/*
 * Copy entry @index into @entry (zeroes if absent). With @nowait, never
 * sleeps on I/O and returns -EWOULDBLOCK instead.
 */
int dd_array_lookup(struct dd_array *a, u64 index, void *entry, bool nowait)
{
	struct dd_block leaf;
	void *src;
	int r;

	r = dd_hold_entry(a, index, nowait, false, &leaf, &src);
	if (r)
		return r;
	if (!src) {
		memset(entry, 0, a->entry_size);
		return 0;
	}
	/*
	 * A word in a fresh leaf may change in place while we read it
	 * (dd_array_fresh_entry): read it whole, never half old, half new.
	 */
	if (a->entry_size == sizeof(u64))
		*(u64 *)entry = READ_ONCE(*(const u64 *)src);
	else if (a->entry_size == sizeof(u32))
		*(u32 *)entry = READ_ONCE(*(const u32 *)src);
	else
		memcpy(entry, src, a->entry_size);
	dd_bm_release(&leaf);
	return 0;
}

/*
 * Entry @index held for a change in place, with @entry pointing into
 * @leaf, if the running transaction already wrote that leaf: no commit
 * references it, so the change needs no shadowing and no change to its
 * path, and may be made under a lock the array's readers share (word
 * stores, see dd_array_lookup). -EAGAIN when the leaf is absent or
 * older: dd_array_update() then makes it writable. The caller releases
 * the leaf, with dd_bm_release_dirty() if it changed the entry.
 */
int dd_array_fresh_entry(struct dd_array *a, u64 index, struct dd_block *leaf,
			 void **entry)
{
	return dd_hold_entry(a, index, false, true, leaf, entry);
}

/* Copy the entries of leaf @leaf_nr into @entries (zeroes if absent). */
int dd_array_read_leaf(struct dd_array *a, u64 leaf_nr, void *entries)
{
	struct dd_block leaf;
	u64 b;
	int r;

	r = dd_find_leaf(a, leaf_nr, false, &b);
	if (r)
		return r;
	if (!b) {
		memset(entries, 0, (size_t)a->per_leaf * a->entry_size);
		return 0;
	}
	r = dd_read(a, b, 0, false, &leaf);
	if (r)
		return r;
	memcpy(entries, dd_payload(&leaf), (size_t)a->per_leaf * a->entry_size);
	dd_bm_release(&leaf);
	return 0;
}

int dd_array_find_held(struct dd_array *a, u64 leaf_nr, const void *value,
		       u64 *out, unsigned int max, struct dd_block *leaf)
{
	u64 first = leaf_nr * a->per_leaf, b, head = 0;
	bool by_head = a->entry_size >= sizeof(u64);
	const u8 *e;
	u32 i, count;
	int n = 0, r;

	leaf->buf = NULL;
	if (first >= a->nr_entries)
		return -ERANGE;
	count = min_t(u64, a->per_leaf, a->nr_entries - first);
	r = dd_find_leaf(a, leaf_nr, false, &b);
	if (r || !b)
		return r;
	r = dd_read(a, b, 0, false, leaf);
	if (r)
		return r;
	e = dd_payload(leaf);
	/*
	 * A write's candidate leaf is scanned whole: most records differ in
	 * their first word, which is compared inline.
	 */
	if (by_head)
		head = get_unaligned((const u64 *)value);
	for (i = 0; i < count && n < max; i++, e += a->entry_size) {
		if (by_head && get_unaligned((const u64 *)e) != head)
			continue;
		if (!memcmp(e, value, a->entry_size))
			out[n++] = first + i;
	}
	return n;
}

void *dd_array_held_entry(struct dd_array *a, struct dd_block *leaf,
			  u64 index)
{
	u32 slot;

	div_u64_rem(index, a->per_leaf, &slot);
	return dd_slot_entry(a, leaf, slot);
}

/* A writable copy of the block at @*nr (or a new one if absent). */
static int dd_writable(struct dd_array *a, u64 *nr, u8 level,
		       struct dd_block *blk)
{
	struct dd_block_kind kind;
	int r;

	dd_kind(a, level, &kind);
	if (*nr)
		r = dd_bm_shadow(a->bm, *nr, &kind, blk);
	else
		r = dd_bm_new(a->bm, &kind, blk);
	if (!r)
		*nr = blk->nr;
	return r;
}

/*
 * Make the path to entry @index writable in the running transaction and
 * return the leaf, held, with @entry pointing into it. The caller changes
 * the entry and then calls dd_bm_release_dirty(leaf).
 */
int dd_array_update(struct dd_array *a, u64 index, struct dd_block *leaf,
		    void **entry)
{
	struct dd_block node, child;
	__le64 *slot_ptr;
	u64 leaf_nr, b;
	u32 slot;
	u8 level;
	int r;

	if (index >= a->nr_entries)
		return -ERANGE;
	leaf_nr = div_u64_rem(index, a->per_leaf, &slot);

	r = dd_writable(a, &a->root, a->height, &node);
	if (r)
		return r;
	for (level = a->height; level; level--) {
		slot_ptr = &dd_children(&node)[dd_child_slot(leaf_nr, level)];
		b = le64_to_cpu(*slot_ptr);
		r = dd_writable(a, &b, level - 1, &child);
		if (r) {
			dd_bm_release_dirty(&node);
			return r;
		}
		*slot_ptr = cpu_to_le64(b);
		dd_bm_release_dirty(&node);
		node = child;
	}
	*leaf = node;
	*entry = dd_slot_entry(a, leaf, slot);
	return 0;
}

/*
 * The height follows from the size, so a grown array may need a taller
 * tree: each new level is a root whose child 0 is the old root. A leaf
 * keeps its number and its path below the new levels, and the entries
 * past the old end read as zero, as they did in the old last leaf.
 */
int dd_array_grow(struct dd_array *a, u64 nr_entries, void *leaf_buf)
{
	u32 used;
	struct dd_block_kind kind;
	struct dd_array grown;
	struct dd_block blk;
	int r;

	if (nr_entries < a->nr_entries)
		return -EINVAL;
	div_u64_rem(a->nr_entries, a->per_leaf, &used);
	/*
	 * Nothing reads the slots past the end of the old last leaf, so
	 * damage there went unnoticed; growing would make it live.
	 */
	if (used && nr_entries > a->nr_entries) {
		r = dd_array_read_leaf(a, div_u64(a->nr_entries, a->per_leaf),
				       leaf_buf);
		if (r)
			return r;
		if (memchr_inv((u8 *)leaf_buf + used * a->entry_size, 0,
			       (a->per_leaf - used) * a->entry_size)) {
			DMERR("%s: array %u: non-zero entries past its end (%llu)",
			      dd_bm_name(a->bm), a->id, a->nr_entries);
			return -EILSEQ;
		}
	}
	dd_array_init(&grown, a->bm, a->id, a->entry_size, nr_entries, a->root);
	while (a->root && a->height < grown.height) {
		dd_kind(a, a->height + 1, &kind);
		r = dd_bm_new(a->bm, &kind, &blk);
		if (r)
			return r;
		dd_children(&blk)[0] = cpu_to_le64(a->root);
		a->root = blk.nr;
		a->height++;
		dd_bm_release_dirty(&blk);
	}
	a->nr_entries = nr_entries;
	a->height = grown.height;
	return 0;
}

static u64 dd_leaves_below(u8 level)
{
	u64 n = 1;

	while (level--)
		n *= DD_INTERIOR_FANOUT;
	return n;
}

static int dd_next_leaf(struct dd_array *a, u64 b, u8 level, u64 base,
			u64 *leaf_nr, u64 end_leaf)
{
	u64 span = dd_leaves_below(level - 1), child;
	struct dd_block blk;
	u32 i;
	int r;

	r = dd_read(a, b, level, false, &blk);
	if (r)
		return r;
	for (i = dd_child_slot(*leaf_nr, level); i < DD_INTERIOR_FANOUT; i++) {
		u64 first = base + i * span;

		if (first >= end_leaf)
			break;
		child = le64_to_cpu(dd_children(&blk)[i]);
		if (!child)
			continue;
		if (first > *leaf_nr)
			*leaf_nr = first;
		if (level == 1) {
			dd_bm_release(&blk);
			return 0;
		}
		r = dd_next_leaf(a, child, level - 1, first, leaf_nr, end_leaf);
		if (r != -ENODATA) {
			dd_bm_release(&blk);
			return r;
		}
	}
	dd_bm_release(&blk);
	return -ENODATA;
}

/*
 * Advance @leaf_nr to the first present leaf at or after it and before
 * @end_leaf; -ENODATA if there is none. Absent subtrees are skipped whole,
 * so discarding a huge, mostly unmapped range costs little.
 */
int dd_array_next_leaf(struct dd_array *a, u64 *leaf_nr, u64 end_leaf)
{
	if (!a->root || *leaf_nr >= end_leaf)
		return -ENODATA;
	if (!a->height)
		return *leaf_nr == 0 ? 0 : -ENODATA;
	return dd_next_leaf(a, a->root, a->height, 0, leaf_nr, end_leaf);
}

/*
 * Activation reads whole arrays: ask for a node's children up front, in
 * runs of consecutive block numbers, instead of one synchronous read each.
 */
static void dd_prefetch_children(struct dd_array *a, const struct dd_block *blk)
{
	const __le64 *children = dd_children(blk);
	u64 run_start = 0, run_len = 0, c;
	u32 i;

	for (i = 0; i < DD_INTERIOR_FANOUT; i++) {
		c = le64_to_cpu(children[i]);
		if (!c)
			continue;
		if (run_len && c == run_start + run_len) {
			run_len++;
			continue;
		}
		if (run_len)
			dd_bm_prefetch(a->bm, run_start, run_len);
		run_start = c;
		run_len = 1;
	}
	if (run_len)
		dd_bm_prefetch(a->bm, run_start, run_len);
}

static int dd_walk(struct dd_array *a, u64 b, u8 level, u64 leaf_base,
		   dd_leaf_fn fn, void *ctx)
{
	struct dd_block blk;
	u64 span, child;
	u32 i;
	int r;

	r = dd_space_mark_used(&a->bm->space, b);
	if (r) {
		DMERR("%s: metadata block %llu (array %u level %u): %s",
		      dd_bm_name(a->bm), b, a->id, level,
		      r == -EEXIST ? "referenced twice" : "out of range");
		return -EILSEQ;
	}
	if (!level && !fn)
		return 0;	/* the map's leaves are not needed at activation */

	r = dd_read(a, b, level, false, &blk);
	if (r)
		return r;
	/* Copy-on-write relies on committed blocks being older than now. */
	if (le64_to_cpu(dd_hdr(&blk)->txn) >= a->bm->txn) {
		DMERR("%s: metadata block %llu: written by transaction %llu, after the last commit",
		      dd_bm_name(a->bm), b, le64_to_cpu(dd_hdr(&blk)->txn));
		dd_bm_release(&blk);
		return -EILSEQ;
	}
	if (!level) {
		u64 first = leaf_base * a->per_leaf;
		u32 count = min_t(u64, a->per_leaf, a->nr_entries - first);

		r = fn(ctx, first, dd_payload(&blk), count);
		dd_bm_release(&blk);
		return r;
	}
	if (level > 1 || fn)
		dd_prefetch_children(a, &blk);
	span = dd_leaves_below(level - 1);
	for (i = 0; i < DD_INTERIOR_FANOUT && !r; i++) {
		child = le64_to_cpu(dd_children(&blk)[i]);
		if (!child)
			continue;
		if ((leaf_base + i * span) * a->per_leaf >= a->nr_entries) {
			DMERR("%s: metadata block %llu: child %u beyond the array end",
			      dd_bm_name(a->bm), b, i);
			r = -EILSEQ;
			break;
		}
		r = dd_walk(a, child, level - 1, leaf_base + i * span, fn, ctx);
	}
	dd_bm_release(&blk);
	return r;
}

/*
 * Visit the whole array once: every block is marked in use (a block found
 * twice is corruption), and @fn, if given, sees every present leaf.
 */
int dd_array_walk(struct dd_array *a, dd_leaf_fn fn, void *ctx)
{
	if (!a->root)
		return 0;
	return dd_walk(a, a->root, a->height, 0, fn, ctx);
}
