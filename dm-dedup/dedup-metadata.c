// SPDX-License-Identifier: GPL-2.0-only
/*
 * Persistent state of a dedup device; see dedup-metadata.h and
 * Documentation/dedup-format.rst.
 */
#define DM_MSG_PREFIX "dedup"

#include <linux/atomic.h>
#include <linux/device-mapper.h>
#include <linux/lockdep.h>
#include <linux/mutex.h>
#include <linux/random.h>
#include <linux/rwsem.h>
#include <linux/slab.h>
#include <linux/timekeeping.h>
#include <linux/xarray.h>

#include "dedup-array.h"
#include "dedup-journal.h"
#include "dedup-metadata.h"
#include "dedup-reserve.h"
#include "dedup-saved.h"

/*
 * md->lock guards everything in here but the data allocator: lookups take
 * it shared, changes, commits and aborts exclusive. It nests inside the
 * target's transaction lock (dedup-target.h) and outside dm-bufio's.
 * Most changes are made with md->lock held shared: a share, a zero block
 * or a new block whose map, refcount and fingerprint entries lie in
 * leaves the running transaction already wrote changes those entries in
 * place (dd_share_run, dd_zero_in_place, dd_new_in_place), and may
 * free the block it replaces. A change in a batch that must copy a leaf
 * takes md->lock exclusive for itself alone and goes back to shared
 * (downgrade_write), so that the rest of its batch runs beside other
 * writers. Changes in place serialize on md->change_lock,
 * which also guards the accounting below against them; it nests inside
 * md->lock and outside md->data_lock.
 * md->data_lock guards md->data alone, so that handing out a block for new
 * data needs no trip through md->lock; it nests inside md->lock, and so
 * does the journal's lock (dedup-journal.h). Most new blocks do not take
 * md->data_lock either: they come from the per-CPU runs of md->reserve,
 * whose locks nest inside it (dedup-reserve.h). The only
 * call out under these locks is a commit's dd_reusable_fn, which must not
 * call back into this unit; dd_md_release_held calls it under neither.
 * bm stays first: tools/kernel-compat's crash reaches the dm-bufio client
 * through it.
 */
/* The device's name, for log lines; KUnit's metadata has none. */
static const char *dd_cfg_name(const struct dd_md_config *cfg)
{
	return cfg->name ?: "metadata";
}

struct dd_metadata {
	struct dd_bm *bm;
	struct rw_semaphore lock;
	struct mutex change_lock;	/* changes in place, see above */
	struct mutex data_lock;	/* md->data alone, see above */
	struct dd_array map;		/* __le64: PBA + 1, 0 = unmapped */
	struct dd_array refcount;	/* __le32 */
	struct dd_array fingerprint;	/* u8[DD_FP_SIZE] */
	struct dd_space data;		/* physical blocks taken; data_lock */
	struct dd_reserve reserve;	/* taken in data, counted as free */
	/*
	 * Free data blocks: those of data, and those reserved, less those
	 * promised to writes acknowledged before their decision
	 * (dd_md_promise_data), which are in data_promised until taken or
	 * given back. A writer takes blocks from the count before the
	 * allocator, never below zero, and gives back what its run did not
	 * cover; blocks freed are added under data_lock. The device reports
	 * the sum of both counts as free (dd_md_free_data_blocks).
	 */
	atomic64_t data_free;
	atomic64_t data_promised;
	struct dd_md_config cfg;
	struct dd_superblock sb;	/* last committed, identity fields */

	/* accounting of the running transaction */
	u64 mapped;
	u64 live;
	u64 unique_writes;
	u64 duplicate_writes;
	u64 zero_writes;
	u64 discarded;
	u64 in_place_changes;	/* not journaled: this instance's */
	/*
	 * The accounting as the last commit or append holds it: a change
	 * that moves only a count (a zero block over an unmapped one) still
	 * needs an append at the next flush.
	 */
	u64 durable_counters[DD_JR_NR_COUNTERS];

	bool dirty;
	bool read_only;	/* asked for, or after a failure: no more changes */
	bool aborted;	/* rolled back to the last commit; stays so */
	bool needs_check;	/* DD_SB_NEEDS_CHECK is on disk */
	void *leaf_buf;	/* one leaf's entries, for range operations */

	/*
	 * The journal, when the format has one and this instance writes:
	 * every change is noted in it, a flush appends, a commit is its
	 * checkpoint.
	 */
	bool journaled;
	struct dd_journal jnl;
	u64 checkpoints;
	/*
	 * Read-only views of a journal that cannot be applied to the trees
	 * (a read-only open, or after an abort): the map entries it sets,
	 * looked up before the trees.
	 */
	struct xarray overlay;
	bool overlaid;
	struct dd_journal_replayed replayed;
};

static const char *dd_md_name(const struct dd_metadata *md)
{
	return dd_cfg_name(&md->cfg);
}

/* What format version 1 needs: the superblocks and the trees. */
static u64 dd_trees_required(u64 logical_blocks, u64 data_blocks)
{
	u64 trees = dd_array_max_blocks(sizeof(__le64), logical_blocks) +
		    dd_array_max_blocks(sizeof(__le32), data_blocks) +
		    dd_array_max_blocks(DD_FP_SIZE, data_blocks);

	/*
	 * The running transaction may have shadowed every block the last
	 * commit references: twice the full trees is the worst case.
	 */
	return DD_SB_SLOTS + 2 * trees;
}

/*
 * The journal a device of these sizes gets: a quarter of the above,
 * within bounds. It follows from the sizes alone, so that room left on
 * the metadata device for growing them stays free for the trees.
 */
static u64 dd_journal_size(u64 logical_blocks, u64 data_blocks)
{
	return clamp_t(u64, dd_trees_required(logical_blocks, data_blocks) / 4,
		       DD_JOURNAL_MAKE_MIN, DD_JOURNAL_BLOCKS);
}

u64 dd_md_required_blocks(u64 logical_blocks, u64 data_blocks)
{
	return dd_trees_required(logical_blocks, data_blocks) +
	       dd_journal_size(logical_blocks, data_blocks);
}

/* ------------------------------------------------------------------ */
/* superblock */

static bool dd_all_zero(const void *p, size_t len)
{
	return !memchr_inv(p, 0, len);
}

enum dd_sb_state { DD_SB_VALID, DD_SB_ZERO, DD_SB_BAD };

static enum dd_sb_state dd_read_sb(struct dd_bm *bm, u64 slot,
				   struct dd_superblock *sb)
{
	struct dd_block blk;
	enum dd_sb_state st = DD_SB_BAD;

	if (dd_bm_read_raw(bm, slot, &blk))
		return DD_SB_BAD;
	memcpy(sb, blk.data, sizeof(*sb));
	if (dd_all_zero(blk.data, DD_BLOCK_SIZE))
		st = DD_SB_ZERO;
	else if (dd_block_csum_ok(blk.data) &&
		 le32_to_cpu(sb->hdr.type) == DD_BT_SUPER &&
		 le64_to_cpu(sb->hdr.blocknr) == slot &&
		 le64_to_cpu(sb->magic) == DD_SB_MAGIC)
		st = DD_SB_VALID;
	dd_bm_release(&blk);
	return st;
}

static void dd_fill_sb(struct dd_metadata *md, struct dd_superblock *sb)
{
	*sb = md->sb;
	sb->hdr.type = cpu_to_le32(DD_BT_SUPER);
	sb->hdr.txn = cpu_to_le64(md->bm->txn);
	sb->hdr.array = 0;
	sb->hdr.level = 0;
	sb->metadata_blocks = cpu_to_le64(md->bm->nr_blocks);
	sb->map_root = cpu_to_le64(md->map.root);
	sb->refcount_root = cpu_to_le64(md->refcount.root);
	sb->fingerprint_root = cpu_to_le64(md->fingerprint.root);
	sb->mapped_blocks = cpu_to_le64(md->mapped);
	sb->used_data_blocks = cpu_to_le64(md->live);
	sb->unique_writes = cpu_to_le64(md->unique_writes);
	sb->duplicate_writes = cpu_to_le64(md->duplicate_writes);
	sb->zero_writes = cpu_to_le64(md->zero_writes);
	sb->discarded_blocks = cpu_to_le64(md->discarded);
	/* A save describes one superblock's state only: dd_md_save's. */
	sb->saved_root = 0;
	sb->saved_words = 0;
	if (md->journaled) {
		sb->journal_seq = cpu_to_le64(dd_journal_next_epoch(&md->jnl));
		/* Its appends are written with their data flush on its way. */
		if (!md->cfg.flush_first)
			sb->flags |= cpu_to_le32(DD_SB_UNFLUSHED_APPENDS);
	}
}

static void dd_journal_geometry(const struct dd_metadata *md,
				struct dd_journal_geometry *geo)
{
	const struct dd_superblock *sb = &md->sb;

	geo->start = le64_to_cpu(sb->journal_start);
	geo->nr_blocks = le64_to_cpu(sb->journal_blocks);
	geo->id = le64_to_cpu(sb->journal_id);
	geo->epoch = le64_to_cpu(sb->journal_seq);
	geo->logical_blocks = le64_to_cpu(sb->logical_blocks);
	geo->data_blocks = le64_to_cpu(sb->data_blocks);
	geo->unflushed = le32_to_cpu(sb->flags) & DD_SB_UNFLUSHED_APPENDS;
}

/* From now on this instance appends, from sequence number @next_seq. */
static int dd_journal_start(struct dd_metadata *md, u64 next_seq)
{
	struct dd_journal_geometry geo;
	int r;

	dd_journal_geometry(md, &geo);
	r = dd_journal_init(&md->jnl, md->bm, &geo, next_seq);
	md->journaled = !r;
	return r;
}

/*
 * A new journal run, on a new device or one of format version 1: the
 * size the table's sizes ask for, or on a version 1 device short of
 * room, what the trees leave; halved while no free run is that long.
 */
static int dd_journal_make(struct dd_metadata *md)
{
	struct dd_superblock *sb = &md->sb;
	u64 trees = dd_trees_required(md->cfg.logical_blocks,
				      md->cfg.data_blocks);
	u64 len, start;
	int r = -ENOSPC;

	if (trees >= md->bm->nr_blocks)
		return -ENOSPC;
	len = dd_journal_size(md->cfg.logical_blocks, md->cfg.data_blocks);
	len = min(len, md->bm->nr_blocks - trees);
	for (; len >= DD_JOURNAL_MAKE_MIN; len /= 2) {
		r = dd_space_alloc_exact(&md->bm->space, len, &start);
		if (!r)
			break;
	}
	if (r)
		return r;
	sb->version = cpu_to_le32(DD_FORMAT_VERSION);
	sb->journal_start = cpu_to_le64(start);
	sb->journal_blocks = cpu_to_le64(len);
	sb->journal_id = cpu_to_le64(get_random_u64() | 1);
	sb->journal_seq = cpu_to_le64(1);
	/* A new id: no block of the run can continue its journal. */
	return dd_journal_start(md, 1);
}

/* The journal's run is used space; a tree block there is damage. */
static int dd_journal_claim(struct dd_metadata *md)
{
	u64 b = le64_to_cpu(md->sb.journal_start);
	u64 end = b + le64_to_cpu(md->sb.journal_blocks);

	for (; b < end; b++) {
		if (dd_space_is_used(&md->bm->space, b) ||
		    dd_space_mark_used(&md->bm->space, b)) {
			DMERR("%s: metadata block %llu: in the journal and used otherwise",
			      dd_md_name(md), b);
			return -EILSEQ;
		}
	}
	return 0;
}

/* A save covers the run; one of format version 1 was upgraded since. */
static void dd_journal_claim_saved(struct dd_metadata *md)
{
	u64 b = le64_to_cpu(md->sb.journal_start);
	u64 end = b + le64_to_cpu(md->sb.journal_blocks);

	for (; b < end; b++)
		if (!dd_space_is_used(&md->bm->space, b))
			dd_space_mark_used(&md->bm->space, b);
}

static void dd_note(struct dd_metadata *md, u8 type, u64 index,
		    const void *value, size_t len)
{
	/* The order of the notes is the order of the changes. */
	lockdep_assert(lockdep_is_held_type(&md->lock, 0) ||
		       lockdep_is_held(&md->change_lock));
	if (md->journaled)
		dd_journal_note(&md->jnl, type, index, value, len);
}

/* A map or refcount change: the journal keeps both as 8 bytes. */
static void dd_note_word(struct dd_metadata *md, u8 type, u64 index, u64 v)
{
	__le64 w = cpu_to_le64(v);

	dd_note(md, type, index, &w, sizeof(w));
}

/* The accounting of the last commit, as the running transaction's start. */
static void dd_load_committed_counters(struct dd_metadata *md)
{
	const struct dd_superblock *sb = &md->sb;

	md->mapped = le64_to_cpu(sb->mapped_blocks);
	md->live = le64_to_cpu(sb->used_data_blocks);
	md->unique_writes = le64_to_cpu(sb->unique_writes);
	md->duplicate_writes = le64_to_cpu(sb->duplicate_writes);
	md->zero_writes = le64_to_cpu(sb->zero_writes);
	md->discarded = le64_to_cpu(sb->discarded_blocks);
}

static int dd_format(struct dd_metadata *md)
{
	struct dd_superblock *sb = &md->sb;
	const struct dd_md_config *cfg = &md->cfg;
	int r;

	memset(sb, 0, sizeof(*sb));
	sb->magic = cpu_to_le64(DD_SB_MAGIC);
	sb->version = cpu_to_le32(DD_FORMAT_VERSION);
	sb->block_size = cpu_to_le32(DD_BLOCK_SIZE);
	sb->data_blocks = cpu_to_le64(cfg->data_blocks);
	sb->logical_blocks = cpu_to_le64(cfg->logical_blocks);
	strscpy(sb->hash_name, cfg->hash_name, sizeof(sb->hash_name));
	sb->fp_size = cpu_to_le32(cfg->fp_size);
	sb->format_time = cpu_to_le64(ktime_get_real_seconds());
	md->bm->txn = 1;
	md->dirty = true;
	r = dd_journal_make(md);
	if (!r)
		r = dd_md_commit(md, NULL, NULL);
	return r;
}

static bool dd_grows(u64 table, __le64 recorded)
{
	return table > le64_to_cpu(recorded);
}

/* The table is larger than the superblock md->sb in either size. */
static bool dd_table_grows(const struct dd_metadata *md)
{
	return dd_grows(md->cfg.logical_blocks, md->sb.logical_blocks) ||
	       dd_grows(md->cfg.data_blocks, md->sb.data_blocks);
}

/* The table and the metadata must describe the same device, or a grown one. */
static int dd_check_sb(struct dd_metadata *md, char **error)
{
	const struct dd_superblock *sb = &md->sb;
	const struct dd_md_config *cfg = &md->cfg;

	u64 jstart = le64_to_cpu(sb->journal_start);
	u64 jblocks = le64_to_cpu(sb->journal_blocks);

	if (le32_to_cpu(sb->version) != DD_FORMAT_VERSION &&
	    le32_to_cpu(sb->version) != DD_FORMAT_VERSION_V1) {
		*error = "metadata format version not supported";
		return -EINVAL;
	}
	if (le32_to_cpu(sb->version) == DD_FORMAT_VERSION_V1 ?
	    jstart || jblocks || sb->journal_seq || sb->journal_id :
	    jblocks < DD_JOURNAL_MIN_BLOCKS || jblocks > DD_JOURNAL_BLOCKS ||
	    jstart < DD_FIRST_TREE_BLOCK ||
	    jstart + jblocks > le64_to_cpu(sb->metadata_blocks) ||
	    jstart + jblocks < jstart || !sb->journal_id) {
		*error = "metadata superblock is damaged (journal fields)";
		return -EINVAL;
	}
	if (le32_to_cpu(sb->block_size) != DD_BLOCK_SIZE ||
	    le32_to_cpu(sb->fp_size) > DD_FP_SIZE) {
		*error = "metadata superblock is damaged (block or fingerprint size)";
		return -EINVAL;
	}
	if (le64_to_cpu(sb->hdr.txn) > DD_MAX_TXN) {
		*error = "metadata superblock is damaged (transaction id near the 2^64 limit)";
		return -EINVAL;
	}
	if (le32_to_cpu(sb->flags) & ~DD_SB_KNOWN_FLAGS) {
		*error = "metadata superblock has unknown flags";
		return -EINVAL;
	}
	if (le64_to_cpu(sb->metadata_blocks) > md->bm->nr_blocks) {
		*error = "metadata device is smaller than when it was formatted";
		return -EINVAL;
	}
	/*
	 * A larger table grows the device (dd_grow); a smaller one would drop
	 * mapped blocks or stored data, so it is refused whatever they hold.
	 */
	if (cfg->logical_blocks < le64_to_cpu(sb->logical_blocks)) {
		*error = "cannot shrink the logical size (field logical_blocks)";
		return -EINVAL;
	}
	if (cfg->data_blocks < le64_to_cpu(sb->data_blocks)) {
		*error = "cannot shrink the data device (field data_blocks)";
		return -EINVAL;
	}
	if (le64_to_cpu(sb->hdr.txn) >= DD_MAX_TXN && dd_table_grows(md)) {
		*error = "cannot grow at the transaction id limit: run dedup repair";
		return -EINVAL;
	}
	if (md->read_only && dd_table_grows(md)) {
		*error = md->needs_check ?
			 "cannot grow a device flagged needs_check: run dedup check first" :
			 "cannot grow a read-only device: drop read_only and --readonly";
		return -EINVAL;
	}
	if (strncmp(sb->hash_name, cfg->hash_name, sizeof(sb->hash_name)) ||
	    le32_to_cpu(sb->fp_size) != cfg->fp_size) {
		*error = "hash algorithm differs from the metadata (field hash)";
		return -EINVAL;
	}
	return 0;
}

/* ------------------------------------------------------------------ */
/* activation: rebuild what lives only in memory */

struct dd_scan {
	struct dd_metadata *md;
	u64 refs;
	u64 live;
	u64 fingerprinted;
};

static int dd_scan_refcounts(void *ctx, u64 first, const void *entries,
			     u32 count)
{
	const __le32 *rc = entries;
	struct dd_scan *scan = ctx;
	u32 i;

	for (i = 0; i < count; i++) {
		if (!rc[i])
			continue;
		if (dd_space_mark_used(&scan->md->data, first + i))
			return -EILSEQ;
		scan->refs += le32_to_cpu(rc[i]);
		scan->live++;
	}
	return 0;
}

static int dd_scan_fingerprints(void *ctx, u64 first, const void *entries,
				u32 count)
{
	struct dd_scan *scan = ctx;
	struct dd_metadata *md = scan->md;
	const u8 *fp = entries;
	u32 i;
	int r;

	for (i = 0; i < count; i++, fp += DD_FP_SIZE) {
		if (!dd_space_is_used(&md->data, first + i))
			continue;
		/*
		 * A short digest (crc32c) can be all zeros; a long one that is
		 * means the record was never written.
		 */
		if (md->cfg.fp_size >= 16 && dd_all_zero(fp, DD_FP_SIZE))
			continue;
		scan->fingerprinted++;
		if (md->cfg.visit) {
			r = md->cfg.visit(md->cfg.ctx, first + i, fp);
			if (r)
				return r;
		}
	}
	return 0;
}

/*
 * The state saved at the last clean close, if the superblock names one
 * and it matches: then no tree needs a walk. Anything amiss (a save left
 * behind by a superblock that was lost, other sizes) means a rebuild,
 * from a clean slate.
 */
static bool dd_activate_saved(struct dd_metadata *md)
{
	const struct dd_superblock *sb = &md->sb;
	struct dd_md_saved *saved = md->cfg.saved;
	const __le64 roots[] = {
		sb->map_root, sb->refcount_root, sb->fingerprint_root
	};
	const char *why = NULL;
	unsigned int i;
	u64 root, b;
	int r;

	/* No writer saves with the flag set; a crafted one is not trusted. */
	if (!saved || !sb->saved_root || md->needs_check)
		return false;
	r = dd_saved_load(md->bm, &md->data, le64_to_cpu(sb->saved_root),
			  le64_to_cpu(sb->saved_words),
			  le64_to_cpu(sb->hdr.txn), saved, &why);
	if (!r && md->data.nr_used != le64_to_cpu(sb->used_data_blocks)) {
		why = "live data blocks differ from the superblock";
		r = -EILSEQ;
	}
	/*
	 * The roots, at least, must be the trees' own blocks: in the saved
	 * bitmap, not blocks of the save itself (those are pending, freed at
	 * the next commit). Nor may the save lie in the journal's run, which
	 * its next commit would free for the trees.
	 */
	for (i = 0; !r && i < ARRAY_SIZE(roots); i++) {
		root = le64_to_cpu(roots[i]);
		if (root && (!dd_space_is_used(&md->bm->space, root) ||
			     dd_space_is_pending(&md->bm->space, root))) {
			why = "a tree root is not in the metadata bitmap";
			r = -EILSEQ;
		}
	}
	for (b = le64_to_cpu(sb->journal_start);
	     !r && b < le64_to_cpu(sb->journal_start) +
		       le64_to_cpu(sb->journal_blocks); b++) {
		if (dd_space_is_pending(&md->bm->space, b)) {
			why = "the save lies in the journal's run";
			r = -EILSEQ;
		}
	}
	if (!r && md->cfg.saved_ok)
		r = md->cfg.saved_ok(md->cfg.ctx, saved, &md->data, &why);
	if (!r) {
		saved->loaded = true;
		return true;
	}
	saved->why = why;
	dd_space_reset(&md->bm->space);
	dd_space_reset(&md->data);
	memset(&saved->head[1], 0, sizeof(saved->head) - sizeof(saved->head[0]));
	memset(saved->words, 0, array_size(saved->nr_words, sizeof(u64)));
	return false;
}

/* ------------------------------------------------------------------ */
/* journal replay */

static int dd_write_state(struct dd_metadata *md, u64 saved_root,
			  u64 saved_words);

/* The accounting, in the order of the journal's COUNTERS record. */
static void dd_counters(const struct dd_metadata *md, u64 *c)
{
	c[0] = md->mapped;
	c[1] = md->live;
	c[2] = md->unique_writes;
	c[3] = md->duplicate_writes;
	c[4] = md->zero_writes;
	c[5] = md->discarded;
}

static void dd_replayed_counters(struct dd_metadata *md, const void *value)
{
	const __le64 *v = value;

	md->mapped = le64_to_cpu(v[0]);
	md->live = le64_to_cpu(v[1]);
	md->unique_writes = le64_to_cpu(v[2]);
	md->duplicate_writes = le64_to_cpu(v[3]);
	md->zero_writes = le64_to_cpu(v[4]);
	md->discarded = le64_to_cpu(v[5]);
}

/* A record applied to the trees, as the change that made it did. */
static int dd_apply(void *ctx, u8 type, u64 index, const void *value)
{
	struct dd_metadata *md = ctx;
	struct dd_array *a;
	struct dd_block leaf;
	void *e;
	int r;

	switch (type) {
	case DD_JR_MAP:
		a = &md->map;
		break;
	case DD_JR_REFCOUNT:
		a = &md->refcount;
		break;
	case DD_JR_FINGERPRINT:
		a = &md->fingerprint;
		break;
	default:
		dd_replayed_counters(md, value);
		return 0;
	}
	r = dd_array_update(a, index, &leaf, &e);
	if (r)
		return r;
	if (type == DD_JR_REFCOUNT)
		*(__le32 *)e = cpu_to_le32(le64_to_cpu(*(const __le64 *)value));
	else
		memcpy(e, value, a->entry_size);
	dd_bm_release_dirty(&leaf);
	return 0;
}

/*
 * A record kept in memory: only the map matters to reads. A read-only
 * open also counts the data blocks stored since the last commit as used,
 * as they are once a read-write open has replayed them; after an abort
 * the running allocator already has them.
 */
static int dd_apply_overlay(void *ctx, u8 type, u64 index, const void *value)
{
	struct dd_metadata *md = ctx;
	u64 v;

	if (type == DD_JR_COUNTERS) {
		dd_replayed_counters(md, value);
		return 0;
	}
	if (type != DD_JR_MAP && type != DD_JR_REFCOUNT)
		return 0;
	v = le64_to_cpu(*(const __le64 *)value);
	if (type == DD_JR_REFCOUNT) {
		/* -EEXIST: the trees have it already; nothing else to do */
		if (v && !md->aborted)
			dd_space_mark_used(&md->data, index);
		return 0;
	}
	return xa_err(xa_store(&md->overlay, index, xa_mk_value(v),
			       GFP_NOIO));
}

/*
 * The newest append was written while its data was being flushed, and
 * the crash came before that flush completed: it was never acknowledged.
 */
static void dd_replay_dropped(struct dd_metadata *md)
{
	if (md->replayed.dropped)
		DMWARN("%s: journal: last append (%llu blocks) dropped: data block %llu lost",
		       dd_md_name(md), md->replayed.dropped,
		       md->replayed.dropped_pba);
}

/*
 * The journal of the state read, in memory: read-only opens, and an
 * instance that aborted after appending. @verify (with @vctx) checks the
 * newest append's data, if it was written unflushed and, with a
 * @check_seq, starts at *@check_seq; NULL: applied as it is.
 */
static int dd_replay_overlay(struct dd_metadata *md, dd_journal_verify_fn verify,
			     void *vctx, const u64 *check_seq)
{
	struct dd_journal_geometry geo;
	int r;

	dd_journal_geometry(md, &geo);
	xa_destroy(&md->overlay);
	md->overlaid = false;
	r = dd_journal_replay(md->bm, &geo, dd_apply_overlay, md,
			      verify, vctx, check_seq, &md->replayed);
	if (r) {
		xa_destroy(&md->overlay);
		return r;
	}
	md->overlaid = md->replayed.blocks > 0;
	return 0;
}

/*
 * Apply the journal to the trees and checkpoint the result, before
 * anything else looks at them: the trees' blocks are marked used (no
 * leaf is read) so that the changes shadow onto free blocks, and the
 * allocation state is rebuilt from scratch afterwards.
 */
static int dd_replay_trees(struct dd_metadata *md, char **error)
{
	struct dd_journal_geometry geo;
	u64 t0 = ktime_get_ns();
	int r;

	dd_journal_geometry(md, &geo);
	r = dd_journal_has_records(md->bm, &geo);
	if (r <= 0) {
		if (r)
			*error = "cannot read the journal";
		return r;
	}
	r = dd_journal_claim(md);
	if (!r)
		r = dd_array_walk(&md->map, NULL, NULL);
	if (!r)
		r = dd_array_walk(&md->refcount, NULL, NULL);
	if (!r)
		r = dd_array_walk(&md->fingerprint, NULL, NULL);
	/* Only such a superblock's newest append may need its data checked. */
	if (!r && geo.unflushed && md->cfg.verify && md->cfg.flush_data) {
		r = md->cfg.flush_data(md->cfg.ctx);
		if (r) {
			*error = "cannot flush the data device to check the journal";
			return r;
		}
	}
	if (!r)
		r = dd_journal_replay(md->bm, &geo, dd_apply, md,
				      md->cfg.verify, md->cfg.ctx, NULL,
				      &md->replayed);
	if (!r && md->replayed.blocks) {
		down_write(&md->lock);
		md->dirty = true;
		r = dd_write_state(md, 0, 0);
		md->dirty = false;
		up_write(&md->lock);
	}
	if (r) {
		*error = r == -ENOMEM ? "out of memory while replaying the journal" :
			 "cannot replay the journal (see the lines above); run dedup check";
		return r;
	}
	if (md->replayed.blocks)
		DMINFO("%s: journal replayed: %llu blocks, %llu records in %llu ms",
		       dd_md_name(md), md->replayed.blocks, md->replayed.records,
		       div_u64(ktime_get_ns() - t0, NSEC_PER_MSEC));
	if (md->replayed.torn)
		DMINFO("%s: journal: %llu blocks of an append torn by a crash ignored",
		       dd_md_name(md), md->replayed.torn);
	dd_replay_dropped(md);
	dd_space_reset(&md->bm->space);
	return 0;
}

/*
 * A read-only open cannot write the replayed state: it keeps the map in
 * memory, after the trees were checked as they are on disk.
 */
static int dd_replay_read_only(struct dd_metadata *md, char **error)
{
	int r;

	if (md->journaled || !md->sb.journal_blocks)
		return 0;
	r = dd_replay_overlay(md, md->cfg.verify, md->cfg.ctx, NULL);
	if (r) {
		*error = "cannot replay the journal (see the lines above); run dedup check";
		return r;
	}
	if (md->overlaid)
		DMINFO("%s: journal of %llu blocks applied in memory only (read-only)",
		       dd_md_name(md), md->replayed.blocks);
	dd_replay_dropped(md);
	return 0;
}

static int dd_activate(struct dd_metadata *md, char **error)
{
	const struct dd_superblock *sb = &md->sb;
	struct dd_scan scan = { .md = md };
	int r;

	md->bm->txn = le64_to_cpu(sb->hdr.txn) + 1;
	/* At the committed sizes; dd_grow takes them to the table's. */
	dd_array_init(&md->map, md->bm, DD_ARRAY_MAP, sizeof(__le64),
		      le64_to_cpu(sb->logical_blocks),
		      le64_to_cpu(sb->map_root));
	dd_array_init(&md->refcount, md->bm, DD_ARRAY_REFCOUNT, sizeof(__le32),
		      le64_to_cpu(sb->data_blocks),
		      le64_to_cpu(sb->refcount_root));
	dd_array_init(&md->fingerprint, md->bm, DD_ARRAY_FINGERPRINT,
		      DD_FP_SIZE, le64_to_cpu(sb->data_blocks),
		      le64_to_cpu(sb->fingerprint_root));

	dd_load_committed_counters(md);
	if (md->journaled) {
		r = dd_replay_trees(md, error);
		if (r)
			return r;
	}
	if (dd_activate_saved(md)) {
		dd_journal_claim_saved(md);
		return dd_replay_read_only(md, error);
	}
	r = le64_to_cpu(sb->journal_blocks) ? dd_journal_claim(md) : 0;
	if (!r)
		r = dd_array_walk(&md->map, NULL, NULL);
	if (!r)
		r = dd_array_walk(&md->refcount, dd_scan_refcounts, &scan);
	if (!r)
		r = dd_array_walk(&md->fingerprint, dd_scan_fingerprints, &scan);
	if (r == -ENOMEM) {
		*error = "out of memory while rebuilding the index";
		return r;
	}
	if (r) {
		*error = "metadata is damaged (see the lines above); run dedup check";
		return r;
	}
	if (scan.refs != md->mapped || scan.live != md->live ||
	    scan.fingerprinted != scan.live) {
		DMERR("%s: metadata inconsistent: refcounts sum to %llu, mapped %llu",
		      dd_md_name(md), scan.refs, md->mapped);
		DMERR("%s: metadata inconsistent: live %llu, expected %llu, fingerprinted %llu",
		      dd_md_name(md), scan.live, md->live, scan.fingerprinted);
		*error = "metadata is inconsistent; run dedup check";
		return -EILSEQ;
	}
	return dd_replay_read_only(md, error);
}

/*
 * A table larger than the metadata: the arrays take the new sizes in the
 * running transaction, which dd_commit_loaded commits at once, so a crash
 * before then leaves the device at its old sizes. The new data blocks are
 * free in md->data already, which was sized from the table.
 */
static int dd_grow(struct dd_metadata *md, char **error)
{
	struct dd_superblock *sb = &md->sb;
	u64 logical = md->cfg.logical_blocks, data = md->cfg.data_blocks;
	int r;

	if (!dd_table_grows(md))
		return 0;
	r = dd_array_grow(&md->map, logical, md->leaf_buf);
	if (!r)
		r = dd_array_grow(&md->refcount, data, md->leaf_buf);
	if (!r)
		r = dd_array_grow(&md->fingerprint, data, md->leaf_buf);
	/* Non-zero entries past an old end, or a damaged block: logged. */
	if (r == -EILSEQ) {
		*error = "metadata is damaged (see the lines above); run dedup check";
		return r;
	}
	if (r) {
		*error = "cannot grow the metadata";
		return r;
	}
	if (dd_grows(logical, sb->logical_blocks))
		DMINFO("%s: growing the logical size from %llu to %llu blocks",
		       dd_md_name(md), le64_to_cpu(sb->logical_blocks), logical);
	if (dd_grows(data, sb->data_blocks))
		DMINFO("%s: growing the data device from %llu to %llu blocks",
		       dd_md_name(md), le64_to_cpu(sb->data_blocks), data);
	sb->logical_blocks = cpu_to_le64(logical);
	sb->data_blocks = cpu_to_le64(data);
	return 0;
}

/*
 * Format version 1 has no journal: give it one if a run is free, so
 * that the commit after the load writes version 2.
 */
static void dd_upgrade(struct dd_metadata *md)
{
	int r = dd_journal_make(md);

	if (!r) {
		DMINFO("%s: metadata format 2: journal of %llu blocks at block %llu",
		       dd_md_name(md), le64_to_cpu(md->sb.journal_blocks),
		       le64_to_cpu(md->sb.journal_start));
		return;
	}
	md->sb.version = cpu_to_le32(DD_FORMAT_VERSION_V1);
	md->sb.journal_start = 0;
	md->sb.journal_blocks = 0;
	md->sb.journal_id = 0;
	md->sb.journal_seq = 0;
	DMWARN("%s: metadata format 1 kept: no room for a journal; flushes commit",
	       dd_md_name(md));
}

/*
 * Write the loaded state again, as the next generation, so that both
 * slots name it. The other slot may hold the state before it, which can
 * reference data blocks that the loaded one freed; those are free from
 * now on, so that state must stop being a fallback before any of them is
 * reused (see dedup-space.h). A damaged other slot is rewritten too. Not
 * at DD_MAX_TXN, the last generation that loads: one more would make the
 * device unloadable before anything was written to it.
 *
 * The new generation names a new journal id, so that no block an earlier
 * instance appended can continue this instance's journal, even at the
 * same epoch. That happens after an activation that replayed nothing, if
 * its generation is lost to damage before the next checkpoint: the older
 * slot holds the same state at the epoch before, and the next instance
 * starts its epoch where the lost one did (Documentation/dedup-format.rst,
 * "Epochs and stale blocks").
 */
static int dd_commit_loaded(struct dd_metadata *md, char **error)
{
	__le64 id = md->sb.journal_id;
	int r;

	if (md->journaled)
		md->sb.journal_id = cpu_to_le64(get_random_u64() | 1);
	md->dirty = true;
	r = dd_md_commit(md, NULL, NULL);
	if (r) {
		md->sb.journal_id = id;
		*error = "cannot write the superblock";
	}
	return r;
}

static int dd_too_small(const struct dd_md_config *cfg, u64 nr_blocks,
			u64 need, char **error)
{
	DMERR("%s: metadata device too small: %llu MiB, needs %llu MiB (%llu blocks)",
	      dd_cfg_name(cfg), nr_blocks >> 8, (need + 255) >> 8, need);
	*error = "metadata device too small";
	return -EINVAL;
}

int dd_md_open(struct block_device *bdev, const struct dd_md_config *cfg,
	       struct dd_metadata **mdp, char **error)
{
	u64 nr_blocks = bdev_nr_bytes(bdev) >> DD_BLOCK_SHIFT;
	u64 need = dd_md_required_blocks(cfg->logical_blocks, cfg->data_blocks);
	struct dd_superblock sbs[DD_SB_SLOTS];
	enum dd_sb_state st[DD_SB_SLOTS];
	struct dd_metadata *md;
	int r, best = -1, i;

	/* Format version 1 needs no journal: room for the trees will do. */
	if (nr_blocks < dd_trees_required(cfg->logical_blocks,
					  cfg->data_blocks))
		return dd_too_small(cfg, nr_blocks, need, error);
	md = kzalloc(sizeof(*md), GFP_KERNEL);
	if (!md)
		return -ENOMEM;
	init_rwsem(&md->lock);
	mutex_init(&md->change_lock);
	mutex_init(&md->data_lock);
	xa_init(&md->overlay);
	md->cfg = *cfg;
	md->read_only = cfg->read_only;
	md->leaf_buf = kmalloc(DD_PAYLOAD_SIZE, GFP_KERNEL);
	r = md->leaf_buf ? 0 : -ENOMEM;
	/*
	 * A reloaded table's first open only reads the superblock, while
	 * the live table holds its own allocator: no bitmaps of a data
	 * device's size (hundreds of MiB for 2^32 blocks) for that.
	 */
	if (!r && !cfg->identity_only) {
		r = dd_space_init(&md->data, cfg->data_blocks, 0);
		if (!r)
			r = dd_reserve_init(&md->reserve);
		if (!r)
			r = dd_space_cool_frees(&md->data);
		if (!r && cfg->hold_frees)
			r = dd_space_hold_frees(&md->data);
	}
	if (!r)
		r = dd_bm_create(bdev, nr_blocks, &md->bm);
	if (r) {
		*error = "cannot allocate metadata structures";
		goto bad;
	}
	md->bm->name = cfg->name;

	for (i = 0; i < DD_SB_SLOTS; i++) {
		st[i] = dd_read_sb(md->bm, i, &sbs[i]);
		if (st[i] == DD_SB_VALID &&
		    (best < 0 || le64_to_cpu(sbs[i].hdr.txn) >
				 le64_to_cpu(sbs[best].hdr.txn)))
			best = i;
	}
	if (best < 0) {
		if (st[0] != DD_SB_ZERO || st[1] != DD_SB_ZERO) {
			*error = "no valid superblock, not zeroed: refusing to format";
			r = -EINVAL;
			goto bad;
		}
		if (md->read_only || cfg->identity_only) {
			*error = "metadata device is empty and the table is read-only";
			r = -EINVAL;
			goto bad;
		}
		if (nr_blocks < need) {
			r = dd_too_small(cfg, nr_blocks, need, error);
			goto bad;
		}
		dd_array_init(&md->map, md->bm, DD_ARRAY_MAP, sizeof(__le64),
			      cfg->logical_blocks, 0);
		dd_array_init(&md->refcount, md->bm, DD_ARRAY_REFCOUNT,
			      sizeof(__le32), cfg->data_blocks, 0);
		dd_array_init(&md->fingerprint, md->bm, DD_ARRAY_FINGERPRINT,
			      DD_FP_SIZE, cfg->data_blocks, 0);
		r = dd_format(md);
		if (r) {
			*error = "cannot write the new superblock";
			goto bad;
		}
		DMINFO("%s: formatted metadata: %llu logical, %llu data, %llu metadata blocks",
		       dd_md_name(md), cfg->logical_blocks, cfg->data_blocks, nr_blocks);
	} else {
		/*
		 * A torn superblock write at a crash looks the same as a slot
		 * damaged later; both fall back to the other slot's commit, so
		 * say which one the device is running from.
		 */
		if (st[1 - best] == DD_SB_BAD)
			DMWARN("%s: superblock slot %d is damaged; using slot %d, transaction %llu",
			       dd_md_name(md), 1 - best, best, le64_to_cpu(sbs[best].hdr.txn));
		md->sb = sbs[best];
		if (le32_to_cpu(md->sb.flags) & DD_SB_NEEDS_CHECK) {
			md->needs_check = true;
			md->read_only = true;
		}
		r = dd_check_sb(md, error);
		/* The trees at the table's sizes, beside the journal there is. */
		need = dd_trees_required(cfg->logical_blocks, cfg->data_blocks) +
		       le64_to_cpu(md->sb.journal_blocks);
		if (!r && nr_blocks < need)
			r = dd_too_small(cfg, nr_blocks, need, error);
		/*
		 * The next epoch starts two rings past the one read, beyond
		 * every block an earlier instance may have written
		 * (Documentation/dedup-format.rst, "Epochs and stale blocks").
		 */
		if (!r && !cfg->identity_only && !md->read_only &&
		    md->sb.journal_blocks) {
			r = dd_journal_start(md,
					     le64_to_cpu(md->sb.journal_seq) +
					     2 * le64_to_cpu(md->sb.journal_blocks));
			if (r)
				*error = "cannot allocate the journal";
		}
		if (!r && !cfg->identity_only)
			r = dd_activate(md, error);
		/*
		 * Not at DD_MAX_TXN: no commit could name the new journal,
		 * and appends to it would be acknowledged and lost.
		 */
		if (!r && !cfg->identity_only && !md->read_only &&
		    !md->sb.journal_blocks &&
		    le64_to_cpu(md->sb.hdr.txn) < DD_MAX_TXN)
			dd_upgrade(md);
		/* dd_check_sb refused growth at DD_MAX_TXN */
		if (!r && !cfg->identity_only && !md->read_only) {
			r = dd_grow(md, error);
			if (!r && le64_to_cpu(md->sb.hdr.txn) < DD_MAX_TXN)
				r = dd_commit_loaded(md, error);
		}
		if (r)
			goto bad;
	}
	/* Nothing is reserved before the first write. */
	atomic64_set(&md->data_free, dd_space_free_blocks(&md->data));
	atomic64_set(&md->data_promised, 0);
	dd_counters(md, md->durable_counters);
	/* Both point into the caller's open only. */
	md->cfg.saved = NULL;
	md->cfg.saved_ok = NULL;
	*mdp = md;
	return 0;
bad:
	dd_md_close(md);
	return r;
}

void dd_md_close(struct dd_metadata *md)
{
	if (md->journaled)
		dd_journal_exit(&md->jnl);
	xa_destroy(&md->overlay);
	if (md->bm)
		dd_bm_destroy(md->bm);
	dd_reserve_exit(&md->reserve);
	dd_space_exit(&md->data);
	kfree(md->leaf_buf);
	kfree(md);
}

/* ------------------------------------------------------------------ */
/* lookups */

/*
 * A map entry holds PBA + 1, or 0. One beyond the data device is damage
 * wherever it is found, by a read or by a change that drops it.
 */
static int dd_map_value_check(struct dd_metadata *md, u64 lba, u64 x)
{
	if (x <= md->cfg.data_blocks)
		return 0;
	DMERR_LIMIT("%s: logical block %llu maps to %llu, beyond the data device",
		    dd_md_name(md), lba, x - 1);
	return -EILSEQ;
}

/* A map entry: 0 for a mapped block, -ENODATA for an unmapped one. */
static int dd_map_entry(struct dd_metadata *md, u64 lba, u64 *pba, bool nowait)
{
	void *e;
	__le64 v;
	u64 x;
	int r;

	lockdep_assert_held(&md->lock);
	e = md->overlaid ? xa_load(&md->overlay, lba) : NULL;
	if (e) {
		x = xa_to_value(e);
	} else {
		r = dd_array_lookup(&md->map, lba, &v, nowait);
		if (r)
			return r;
		x = le64_to_cpu(v);
	}
	if (!x)
		return -ENODATA;
	r = dd_map_value_check(md, lba, x);
	if (r)
		return r;
	*pba = x - 1;
	return 0;
}

int dd_md_lookup(struct dd_metadata *md, u64 lba, u64 *pba, bool nowait)
{
	u64 n;

	return dd_md_lookup_run(md, lba, 1, pba, &n, nowait);
}

int dd_md_lookup_run(struct dd_metadata *md, u64 lba, u64 max, u64 *pba,
		     u64 *nr, bool nowait)
{
	u64 next = U64_MAX;
	int r, r2;

	if (nowait) {
		if (!down_read_trylock(&md->lock))
			return -EWOULDBLOCK;
	} else {
		down_read(&md->lock);
	}
	r = dd_map_entry(md, lba, pba, nowait);
	*nr = 1;
	if (r && r != -ENODATA)
		goto out;
	/* A run goes on while the next block reads from the next place. */
	while (*nr < max) {
		r2 = dd_map_entry(md, lba + *nr, &next, true);
		if (r2 != r || (!r && next != *pba + *nr))
			break;
		(*nr)++;
	}
out:
	up_read(&md->lock);
	return r;
}

static int dd_get_fingerprint(struct dd_metadata *md, u64 pba, u8 *fp)
{
	lockdep_assert_held(&md->lock);
	return dd_array_lookup(&md->fingerprint, pba, fp, false);
}

static int dd_get_refcount(struct dd_metadata *md, u64 pba, u32 *count)
{
	__le32 v;
	int r;

	lockdep_assert_held(&md->lock);
	r = dd_array_lookup(&md->refcount, pba, &v, false);
	if (!r)
		*count = le32_to_cpu(v);
	return r;
}

int dd_md_get_fingerprint(struct dd_metadata *md, u64 pba, u8 *fp)
{
	int r;

	down_read(&md->lock);
	r = dd_get_fingerprint(md, pba, fp);
	up_read(&md->lock);
	return r;
}

int dd_md_get_refcount(struct dd_metadata *md, u64 pba, u32 *count)
{
	int r;

	down_read(&md->lock);
	r = dd_get_refcount(md, pba, count);
	up_read(&md->lock);
	return r;
}

/*
 * Is @pba live with fingerprint @fp? 1/0, or < 0 on error; *rc is its
 * refcount.
 */
static int dd_holds(struct dd_metadata *md, u64 pba, const u8 *fp, u32 *rc)
{
	u8 stored[DD_FP_SIZE];
	int r;

	lockdep_assert_held(&md->lock);
	r = dd_get_refcount(md, pba, rc);
	if (!r && *rc)
		r = dd_get_fingerprint(md, pba, stored);
	if (r)
		return r;
	return *rc && !memcmp(stored, fp, DD_FP_SIZE);
}

/*
 * Up to @max live blocks whose record in fingerprint leaf @leaf equals
 * @fp, with their refcounts: how many. The leaf stays held in @fpl, as
 * dd_array_find_held() leaves it.
 */
static int dd_find_holders_held(struct dd_metadata *md, u64 leaf,
				const u8 *fp, u64 *pba, u32 *rc,
				unsigned int max, struct dd_block *fpl)
{
	int n, i, live = 0, r;

	lockdep_assert_held(&md->lock);
	n = dd_array_find_held(&md->fingerprint, leaf, fp, pba, max, fpl);
	for (i = 0; i < n; i++) {
		r = dd_get_refcount(md, pba[i], &rc[live]);
		if (r) {
			dd_bm_release(fpl);
			return r;
		}
		if (rc[live])
			pba[live++] = pba[i];
	}
	return n < 0 ? n : live;
}

/* The same, the leaf let go. */
static int dd_find_holders(struct dd_metadata *md, u64 leaf, const u8 *fp,
			   u64 *pba, u32 *rc, unsigned int max)
{
	struct dd_block fpl;
	int n = dd_find_holders_held(md, leaf, fp, pba, rc, max, &fpl);

	if (fpl.buf)
		dd_bm_release(&fpl);
	return n;
}

int dd_md_find_holders(struct dd_metadata *md, u64 leaf, const u8 *fp,
		       u64 *pba, unsigned int max)
{
	u32 rc[DD_MD_HOLDERS_MAX];
	int r;

	down_read(&md->lock);
	r = dd_find_holders(md, leaf, fp, pba, rc,
			    min_t(unsigned int, max, DD_MD_HOLDERS_MAX));
	up_read(&md->lock);
	return r;
}

/* Searches of dd_md_first_holders() per hold of the metadata lock. */
#define DD_MD_SEARCHES_PER_HOLD	16

void dd_md_first_holders(struct dd_metadata *md, u64 *at,
			 const u8 *const *fp, unsigned int nr)
{
	u32 rc[DD_MD_HOLDERS_MAX];
	u64 pba[DD_MD_HOLDERS_MAX], last_leaf = 0;
	unsigned int i, last = nr, searched = 0;

	down_read(&md->lock);
	for (i = 0; i < nr; i++) {
		if (!fp[i]) {
			at[i] = DD_MD_NO_HOLDER;
			continue;
		}
		/* A block repeated in a write: one search for all its copies. */
		if (last < nr && at[i] == last_leaf &&
		    !memcmp(fp[i], fp[last], DD_FP_SIZE)) {
			at[i] = at[last];
			continue;
		}
		/*
		 * A writer waiting to copy a leaf waits for a few searches
		 * at most (each may read a leaf). The answers are hints that
		 * the share checks again, so they hold across the gap.
		 */
		if (searched && !(searched % DD_MD_SEARCHES_PER_HOLD)) {
			up_read(&md->lock);
			down_read(&md->lock);
		}
		searched++;
		last = i;
		last_leaf = at[i];
		if (dd_find_holders(md, at[i], fp[i], pba, rc,
				    DD_MD_HOLDERS_MAX) > 0)
			at[i] = pba[0];
		else
			at[i] = DD_MD_NO_HOLDER;
	}
	up_read(&md->lock);
}

int dd_md_holds(struct dd_metadata *md, u64 pba, const u8 *fp)
{
	u32 rc;
	int r;

	down_read(&md->lock);
	r = dd_holds(md, pba, fp, &rc);
	up_read(&md->lock);
	return r;
}

/* ------------------------------------------------------------------ */
/* changes */

static int dd_writable_check(struct dd_metadata *md)
{
	lockdep_assert_held_write(&md->lock);
	if (md->read_only)
		return -EROFS;
	md->dirty = true;
	return 0;
}

int dd_md_alloc_data(struct dd_metadata *md, u64 *pba, u64 *free_left)
{
	u64 len;

	return dd_md_alloc_data_run(md, 1, false, pba, &len, free_left);
}

/*
 * Blocks that became free in md->data since it had @before free ones
 * count as free on the device too. A reservation's fill and drain move
 * blocks between md->data and md->reserve and change nothing here.
 */
static void dd_data_gained(struct dd_metadata *md, u64 before)
{
	lockdep_assert_held(&md->data_lock);
	atomic64_add(dd_space_free_blocks(&md->data) - before, &md->data_free);
}

/* Every CPU's reserved blocks go back to md->data. */
static void dd_reserve_return(struct dd_metadata *md)
{
	u64 first, len;

	lockdep_assert_held(&md->data_lock);
	while (dd_reserve_drain(&md->reserve, &first, &len))
		for (; len; len--)
			dd_space_free_now(&md->data, first++);
}

/*
 * A few blocks, from a fresh run of md->data: those beyond @want become
 * this CPU's reservation. -ENOSPC when md->data has no free block.
 */
static int dd_reserve_refill(struct dd_metadata *md, u64 want, u64 *first,
			     u64 *len)
{
	u64 b, n;
	int r;

	lockdep_assert_held(&md->data_lock);
	/* Another writer on this CPU may have refilled it meanwhile. */
	*len = dd_reserve_take(&md->reserve, want, first);
	if (*len)
		return 0;
	r = dd_space_alloc_run(&md->data, DD_RESERVE_RUN, &b, &n);
	if (r)
		return r;
	*first = b;
	*len = min(want, n);
	if (n > *len && !dd_reserve_fill(&md->reserve, b + *len, n - *len))
		for (b += *len; b < *first + n; b++)
			dd_space_free_now(&md->data, b);
	return 0;
}

/*
 * The count shows no free block for a write that was promised none. The
 * device is full only if the allocator has none either, every CPU's
 * reservation given back, and no promise is out and no freed block is to
 * come back: a block the allocator has while the count shows none is
 * promised, or taken by a writer that gives back what its run did not
 * cover. The write waits for those (-EAGAIN).
 */
static int dd_data_short(struct dd_metadata *md)
{
	int r = -EAGAIN;

	mutex_lock(&md->data_lock);
	dd_reserve_return(md);
	if (!atomic64_read(&md->data_promised) &&
	    !dd_space_free_blocks(&md->data) &&
	    !dd_space_frees_to_come(&md->data))
		r = -ENOSPC;
	mutex_unlock(&md->data_lock);
	return r;
}

/*
 * Between @least and @most of the free blocks the count holds, as many
 * as it has, taken from it: 0 when it has fewer than @least. The count
 * never goes below zero, so that the blocks physically free always cover
 * what was taken and promised.
 */
static u64 dd_data_free_take(struct dd_metadata *md, u64 least, u64 most)
{
	s64 old = atomic64_read(&md->data_free), n;

	do {
		if (old < (s64)least)
			return 0;
		n = min_t(s64, old, most);
	} while (!atomic64_try_cmpxchg(&md->data_free, &old, old - n));
	return n;
}

/*
 * Up to @want of the free blocks the count holds, taken from it before
 * the allocator, so that they never include a promised block. *@want
 * becomes what was taken.
 */
static int dd_data_count_take(struct dd_metadata *md, u64 *want)
{
	u64 n = dd_data_free_take(md, 1, *want);

	if (!n)
		return dd_data_short(md);
	*want = n;
	return 0;
}

bool dd_md_promise_data(struct dd_metadata *md, u64 n)
{
	if (!n)
		return true;
	/* First, so that a writer finding the count short waits for them. */
	atomic64_add(n, &md->data_promised);
	if (READ_ONCE(md->read_only) || !dd_data_free_take(md, n, n)) {
		atomic64_sub(n, &md->data_promised);
		return false;
	}
	return true;
}

void dd_md_promise_drop(struct dd_metadata *md, u64 n)
{
	if (!n)
		return;
	atomic64_add(n, &md->data_free);
	atomic64_sub(n, &md->data_promised);
}

int dd_md_alloc_data_run(struct dd_metadata *md, u64 want, bool promised,
			 u64 *first, u64 *len, u64 *free_left)
{
	int r;

	/* Set by an abort under md->lock: a block handed out late is freed. */
	if (READ_ONCE(md->read_only))
		return -EROFS;
	if (!want)
		return -ENOSPC;
	if (!promised) {
		r = dd_data_count_take(md, &want);
		if (r)
			return r;
	}
	if (want <= DD_RESERVE_MAX_WANT) {
		*len = dd_reserve_take(&md->reserve, want, first);
		if (*len)
			goto taken;
	}
	mutex_lock(&md->data_lock);
	if (want <= DD_RESERVE_MAX_WANT)
		r = dd_reserve_refill(md, want, first, len);
	else
		r = dd_space_alloc_run(&md->data, want, first, len);
	if (r == -ENOSPC) {
		/* Full only if no CPU holds a free block back. */
		dd_reserve_return(md);
		r = dd_space_alloc_run(&md->data, want, first, len);
	}
	if (r == -ENOSPC && dd_space_frees_to_come(&md->data))
		r = -EAGAIN;
	mutex_unlock(&md->data_lock);
	if (r) {
		if (!promised)
			atomic64_add(want, &md->data_free);
		return r;
	}
taken:
	if (promised)
		atomic64_sub(*len, &md->data_promised);
	else if (want > *len)
		atomic64_add(want - *len, &md->data_free);
	*free_left = dd_md_free_data_blocks(md);
	return 0;
}

void dd_md_free_data_now(struct dd_metadata *md, u64 pba)
{
	u64 before;

	mutex_lock(&md->data_lock);
	before = dd_space_free_blocks(&md->data);
	dd_space_free_now(&md->data, pba);
	dd_data_gained(md, before);
	mutex_unlock(&md->data_lock);
}

/*
 * Drop one reference to @pba. Returns 1 and fills *freed when it was the
 * last: the block stays allocated until the commit, since the committed
 * state may still point at it.
 */
static int dd_put_ref(struct dd_metadata *md, u64 pba,
		      struct dd_md_freed *freed)
{
	struct dd_block leaf;
	__le32 *e;
	u32 rc;
	int r;

	r = dd_writable_check(md);
	if (!r)
		r = dd_array_update(&md->refcount, pba, &leaf, (void **)&e);
	if (r)
		return r;
	rc = le32_to_cpu(*e);
	if (rc)
		*e = cpu_to_le32(rc - 1);
	dd_bm_release_dirty(&leaf);
	if (!rc) {
		DMERR_LIMIT("%s: physical block %llu: refcount underflow",
			    dd_md_name(md), pba);
		return -EILSEQ;
	}
	dd_note_word(md, DD_JR_REFCOUNT, pba, rc - 1);
	if (rc > 1)
		return 0;

	md->live--;
	freed->pba = pba;
	r = dd_get_fingerprint(md, pba, freed->fp);
	if (r)
		return r;
	mutex_lock(&md->data_lock);
	dd_space_release(&md->data, pba);
	mutex_unlock(&md->data_lock);
	return 1;
}

/*
 * Point @lba at @value (PBA + 1, or 0), dropping what it pointed at.
 * 1/0 as dd_put_ref.
 */
static int dd_set_map(struct dd_metadata *md, u64 lba, u64 value,
		      struct dd_md_freed *freed)
{
	struct dd_block leaf;
	__le64 *e;
	u64 old;
	int r;

	lockdep_assert_held_write(&md->lock);
	r = dd_array_update(&md->map, lba, &leaf, (void **)&e);
	if (r)
		return r;
	old = le64_to_cpu(*e);
	r = dd_map_value_check(md, lba, old);
	if (r) {
		dd_bm_release(&leaf);
		return r;
	}
	*e = cpu_to_le64(value);
	dd_bm_release_dirty(&leaf);
	dd_note_word(md, DD_JR_MAP, lba, value);
	if (!old)
		md->mapped += !!value;
	else if (!value)
		md->mapped--;
	if (old)
		return dd_put_ref(md, old - 1, freed);
	return 0;
}

static int dd_map_new(struct dd_metadata *md, u64 lba, u64 pba, const u8 *fp,
		      struct dd_md_freed *freed)
{
	struct dd_block leaf;
	void *e;
	u32 rc;
	int r;

	r = dd_writable_check(md);
	if (!r)
		r = dd_array_update(&md->refcount, pba, &leaf, &e);
	if (r)
		return r;
	rc = le32_to_cpu(*(__le32 *)e);
	if (!rc)
		*(__le32 *)e = cpu_to_le32(1);
	dd_bm_release_dirty(&leaf);
	if (rc) {
		DMERR_LIMIT("%s: physical block %llu: allocated while in use",
			    dd_md_name(md), pba);
		return -EILSEQ;
	}
	md->live++;
	dd_note_word(md, DD_JR_REFCOUNT, pba, 1);

	r = dd_array_update(&md->fingerprint, pba, &leaf, &e);
	if (r)
		return r;
	memset(e, 0, DD_FP_SIZE);
	memcpy(e, fp, md->cfg.fp_size);
	dd_note(md, DD_JR_FINGERPRINT, pba, e, DD_FP_SIZE);
	dd_bm_release_dirty(&leaf);

	md->unique_writes++;
	return dd_set_map(md, lba, pba + 1, freed);
}

/* @lba takes a reference to @pba, whose count was @rc. */
static int dd_take_duplicate(struct dd_metadata *md, u64 lba, u64 pba, u32 rc,
			     struct dd_md_freed *freed)
{
	struct dd_block leaf;
	__le32 *e;
	int r;

	if (rc >= DD_REFCOUNT_MAX)
		return -EOVERFLOW;
	r = dd_writable_check(md);
	if (!r)
		r = dd_array_update(&md->refcount, pba, &leaf, (void **)&e);
	if (r)
		return r;
	/* Changes are exclusive: the count is the one just read. */
	*e = cpu_to_le32(rc + 1);
	dd_bm_release_dirty(&leaf);
	dd_note_word(md, DD_JR_REFCOUNT, pba, rc + 1);

	md->duplicate_writes++;
	/*
	 * When @lba already maps @pba this drops the reference just taken,
	 * which is why it had to be taken first: the block is never freed.
	 */
	return dd_set_map(md, lba, pba + 1, freed);
}

static int dd_map_duplicate(struct dd_metadata *md, u64 lba, u64 pba,
			    const u8 *fp, struct dd_md_freed *freed)
{
	u32 rc;
	int r;

	if (md->read_only)
		return -EROFS;
	/*
	 * Look before writing: updating the entry would shadow its path into
	 * the running transaction, and a miss must leave no trace. A block
	 * freed and reused since the caller looked holds other content: the
	 * record decides, in this same step.
	 */
	r = dd_holds(md, pba, fp, &rc);
	if (r <= 0)
		return r ? r : -ENOENT;
	return dd_take_duplicate(md, lba, pba, rc, freed);
}

/*
 * Which of the @n live holders of @d's content to share: the one d->only
 * names, else the first not saturated (a saturated holder may have a copy
 * beside it). -ENOENT when d->only is not among them; -EOVERFLOW when the
 * one picked is saturated.
 */
static int dd_pick_holder(const struct dd_md_dup *d, const u64 *holder,
			  const u32 *rc, int n)
{
	int i;

	if (d->only) {
		for (i = 0; i < n && holder[i] + 1 != d->only; i++)
			;
		if (i == n)
			return -ENOENT;
	} else {
		for (i = 0; i < n - 1 && rc[i] >= DD_REFCOUNT_MAX; i++)
			;
	}
	return rc[i] >= DD_REFCOUNT_MAX ? -EOVERFLOW : i;
}

/* As dd_map_duplicate, with the holder dd_pick_holder() picks in d->leaf. */
static int dd_map_duplicate_in_leaf(struct dd_metadata *md,
				    struct dd_md_dup *d,
				    struct dd_md_freed *freed)
{
	u64 holder[DD_MD_HOLDERS_MAX];
	u32 rc[DD_MD_HOLDERS_MAX];
	int n, i;

	if (md->read_only)
		return -EROFS;
	n = dd_find_holders(md, d->leaf, d->fp, holder, rc, DD_MD_HOLDERS_MAX);
	if (n <= 0)
		return n ? n : -ENOENT;
	i = dd_pick_holder(d, holder, rc, n);
	if (i < 0)
		return i;
	d->pba = holder[i];
	return dd_take_duplicate(md, d->lba, holder[i], rc[i], freed);
}

/*
 * A change in place, and the leaves dd_hold_in_place() holds for it until
 * dd_release_in_place(). @fp is the content's fingerprint when @value is
 * a block: that of a live block to share, whose record @fe points at in
 * a leaf the caller holds, or, with @new_block, that of a new block to
 * record.
 */
struct dd_in_place {
	const u8 *fp;
	bool new_block;
	u8 *fe;
	struct dd_block map, rc, fpl, old_rc;
	__le64 *me;
	__le32 *re, *oe;
	u64 old;
	bool old_fp_read;
	u8 old_fp[DD_FP_SIZE];
};

/*
 * dd_set_map in place, after taking a reference when @value is a block,
 * on the entries dd_hold_in_place() holds in @ip: ip->me is @lba's map
 * entry, which held ip->old (PBA + 1, or 0); ip->re and ip->fe the
 * refcount and fingerprint record of the block @value points at, NULL for
 * 0; ip->oe the refcount of the block ip->old pointed at, NULL when that
 * is nothing or the same block, and ip->old_fp its record, read when
 * dropping the reference looked likely to free it.
 * 1 when the block @lba pointed at is freed (*@freed says which), 0, or
 * -ENOENT, -EOVERFLOW as dd_take_duplicate. -EAGAIN: take the exclusive
 * path, which says what is wrong if anything is.
 */
static int dd_remap_in_place(struct dd_metadata *md, u64 lba, u64 value,
			     const struct dd_in_place *ip,
			     struct dd_md_freed *freed)
{
	__le32 *re = ip->re, *oe = ip->oe;
	__le64 *me = ip->me;
	u64 old = ip->old;
	u32 rc = 0, orc = 0;

	lockdep_assert_held_read(&md->lock);
	lockdep_assert_held(&md->change_lock);
	/*
	 * A freed block is reused only after a commit, which cannot run
	 * under md->lock; but other changes in place may have moved a count,
	 * or recorded a new block over a dead one's record, since the caller
	 * looked. Under change_lock neither moves.
	 */
	if (re) {
		rc = le32_to_cpu(READ_ONCE(*re));
		if (ip->new_block) {
			if (rc)
				return -EAGAIN;
		} else if (!rc || memcmp(ip->fe, ip->fp, DD_FP_SIZE)) {
			return -ENOENT;
		} else if (rc >= DD_REFCOUNT_MAX) {
			return -EOVERFLOW;
		}
	}
	/* Changes to one logical block are ordered (cells): never true. */
	if (WARN_ON_ONCE(le64_to_cpu(READ_ONCE(*me)) != old))
		return -EAGAIN;
	if (oe) {
		orc = le32_to_cpu(READ_ONCE(*oe));
		if (!orc || (orc == 1 && !ip->old_fp_read))
			return -EAGAIN;
	}
	WRITE_ONCE(md->dirty, true);
	if (old == value)
		return 0;	/* a reference taken and dropped at once */
	if (ip->new_block) {
		/*
		 * The record first: a reader that finds it may take the block
		 * for live once its count is set, and then looks again here.
		 */
		memcpy(ip->fe, ip->fp, md->cfg.fp_size);
		memset(ip->fe + md->cfg.fp_size, 0,
		       DD_FP_SIZE - md->cfg.fp_size);
		WRITE_ONCE(*re, cpu_to_le32(1));
		md->live++;
		dd_note_word(md, DD_JR_REFCOUNT, value - 1, 1);
		dd_note(md, DD_JR_FINGERPRINT, value - 1, ip->fe, DD_FP_SIZE);
	} else if (re) {
		WRITE_ONCE(*re, cpu_to_le32(rc + 1));
		dd_note_word(md, DD_JR_REFCOUNT, value - 1, rc + 1);
	}
	WRITE_ONCE(*me, cpu_to_le64(value));
	dd_note_word(md, DD_JR_MAP, lba, value);
	if (!old)
		md->mapped++;
	else if (!value)
		md->mapped--;
	if (!oe)
		return 0;
	WRITE_ONCE(*oe, cpu_to_le32(orc - 1));
	dd_note_word(md, DD_JR_REFCOUNT, old - 1, orc - 1);
	if (orc > 1)
		return 0;
	md->live--;
	freed->pba = old - 1;
	memcpy(freed->fp, ip->old_fp, DD_FP_SIZE);
	mutex_lock(&md->data_lock);
	dd_space_release(&md->data, old - 1);
	mutex_unlock(&md->data_lock);
	return 1;
}

static void dd_release_one(struct dd_block *blk, bool changed)
{
	if (changed)
		dd_bm_release_dirty(blk);
	else
		dd_bm_release(blk);
}

/*
 * No change in place once the metadata is read-only, nor while a journal
 * the trees do not hold is read through an overlay: the exclusive path
 * refuses them, and says why.
 */
static bool dd_in_place_refused(struct dd_metadata *md)
{
	return READ_ONCE(md->read_only) || md->overlaid;
}

/* Most leaves one change in place holds: map, two refcounts, record. */
#define DD_IN_PLACE_LEAVES	4

/*
 * The leaves dd_hold_in_place() holds in @ip, all or part of them, put
 * in @blk; returns how many.
 */
static unsigned int dd_in_place_leaves(struct dd_in_place *ip,
				       struct dd_block **blk)
{
	unsigned int n = 0;

	if (ip->oe)
		blk[n++] = &ip->old_rc;
	if (ip->new_block && ip->fe)
		blk[n++] = &ip->fpl;
	if (ip->re)
		blk[n++] = &ip->rc;
	blk[n++] = &ip->map;
	return n;
}

/* Let go of what dd_hold_in_place() holds, all or part of it. */
static void dd_release_in_place(struct dd_in_place *ip, bool changed)
{
	struct dd_block *blk[DD_IN_PLACE_LEAVES];
	unsigned int k, n = dd_in_place_leaves(ip, blk);

	for (k = 0; k < n; k++)
		dd_release_one(blk[k], changed);
}

/* A change in place made: counted in *@count (its kind) and in all. */
static void dd_count_in_place(struct dd_metadata *md, u64 *count)
{
	lockdep_assert_held(&md->change_lock);
	(*count)++;
	md->in_place_changes++;
}

/*
 * Hold @lba's map entry and the entries a change of it to @value (PBA +
 * 1, or 0) touches, if the leaves it changes are fresh; ip->old is what
 * @lba maps. The caller zeroed @ip but for what struct dd_in_place says
 * it sets. -EAGAIN: a leaf is not fresh, take the exclusive path.
 */
static int dd_hold_in_place(struct dd_metadata *md, u64 lba, u64 value,
			    struct dd_in_place *ip)
{
	int r;

	r = dd_array_fresh_entry(&md->map, lba, &ip->map, (void **)&ip->me);
	if (r)
		return r;
	/* Only the caller's change moves it (cells order them). */
	ip->old = le64_to_cpu(READ_ONCE(*ip->me));
	r = dd_map_value_check(md, lba, ip->old);
	if (r)
		goto out;
	if (value) {
		r = dd_array_fresh_entry(&md->refcount, value - 1, &ip->rc,
					 (void **)&ip->re);
		if (!r && ip->new_block) {
			r = dd_array_fresh_entry(&md->fingerprint, value - 1,
						 &ip->fpl, (void **)&ip->fe);
			if (!r && !ip->fe)
				r = -EAGAIN;
		}
		if (r)
			goto out;
	}
	if (ip->old && ip->old != value) {
		r = dd_array_fresh_entry(&md->refcount, ip->old - 1,
					 &ip->old_rc, (void **)&ip->oe);
		if (r)
			goto out;
		/*
		 * Its record goes to the caller if the block is freed; a live
		 * block's record does not change, so it can be read now.
		 */
		if (le32_to_cpu(READ_ONCE(*ip->oe)) == 1) {
			r = dd_get_fingerprint(md, ip->old - 1, ip->old_fp);
			if (r)
				goto out;
			ip->old_fp_read = true;
		}
	}
	return 0;
out:
	dd_release_in_place(ip, false);
	return r;
}

/*
 * Make the change to @value that dd_hold_in_place() prepared in @ip,
 * counted in *@count (the kind of write) and in in_place_changes, and
 * let the leaves go. Results as dd_remap_in_place.
 */
static int dd_change_in_place(struct dd_metadata *md, u64 lba, u64 value,
			      struct dd_in_place *ip, u64 *count,
			      struct dd_md_freed *freed)
{
	int r;

	mutex_lock(&md->change_lock);
	r = dd_remap_in_place(md, lba, value, ip, freed);
	if (r >= 0)
		dd_count_in_place(md, count);
	mutex_unlock(&md->change_lock);
	dd_release_in_place(ip, r >= 0);
	return r;
}

/*
 * The result of a share that ends a call of dd_md_map_duplicates: a
 * free, or a hard error.
 */
static bool dd_dup_ends_run(int r)
{
	return r == 1 || (r < 0 && r != -ENOENT && r != -EOVERFLOW);
}

/*
 * Shares made per hold of md->change_lock. A batch of duplicates (a
 * sequential write of known content) took and dropped that mutex once
 * per block, and writers queued on it; a run holds its leaves first,
 * outside it, so that the hold covers only the changes themselves.
 */
#define DD_SHARE_RUN	8

/* A share held for a run: its change in place, and its record's leaf. */
struct dd_share_held {
	struct dd_in_place ip;
	struct dd_block fpl;
};

/*
 * The first half of dd_map_duplicate_in_leaf with md->lock held shared:
 * find the holder to share, and hold in @h every entry sharing it
 * changes, when they all lie in leaves the running transaction already
 * wrote (after each checkpoint, the first change to a leaf copies it
 * under the exclusive lock). 0: held, for dd_share_run(). Else nothing
 * is held and the result is dd_map_duplicate_in_leaf's, or -EAGAIN:
 * take the exclusive path.
 */
static int dd_share_hold(struct dd_metadata *md, struct dd_md_dup *d,
			 struct dd_share_held *h)
{
	u64 holder[DD_MD_HOLDERS_MAX];
	u32 rc[DD_MD_HOLDERS_MAX];
	int n, i, r;

	lockdep_assert_held_read(&md->lock);
	memset(h, 0, sizeof(*h));
	if (dd_in_place_refused(md))
		return -EAGAIN;
	/*
	 * The leaf stays held: the record found must be compared again
	 * once no change in place can move it (dd_remap_in_place).
	 */
	n = dd_find_holders_held(md, d->leaf, d->fp, holder, rc,
				 DD_MD_HOLDERS_MAX, &h->fpl);
	if (n <= 0) {
		r = n ? n : -ENOENT;
		goto out;
	}
	i = dd_pick_holder(d, holder, rc, n);
	r = i;
	if (i < 0)
		goto out;
	d->pba = holder[i];
	h->ip.fp = d->fp;
	h->ip.fe = dd_array_held_entry(&md->fingerprint, &h->fpl, d->pba);
	r = dd_hold_in_place(md, d->lba, d->pba + 1, &h->ip);
	if (!r)
		return 0;
out:
	if (h->fpl.buf)
		dd_bm_release(&h->fpl);
	return r;
}

/*
 * Let go of a run's @nr holds, of which the first @made were made, each
 * a change if d[j].r says so. A leaf several of them changed (the map
 * leaf of neighbouring logical blocks, the refcount leaf of a holder
 * shared again) is marked dirty once: each mark takes dm-bufio's client
 * lock, which every writer's marks queue on. Pointers compare safely: a
 * buffer let go here cannot be freed and reused for one still held.
 */
static void dd_share_release(struct dd_share_held *h,
			     const struct dd_md_dup *d, unsigned int nr,
			     unsigned int made)
{
	const struct dm_buffer *marked[DD_SHARE_RUN * DD_IN_PLACE_LEAVES];
	struct dd_block *blk[DD_IN_PLACE_LEAVES];
	unsigned int j, k, m, nb, n = 0;

	for (j = 0; j < nr; j++) {
		nb = dd_in_place_leaves(&h[j].ip, blk);
		for (k = 0; k < nb; k++) {
			for (m = 0; m < n && marked[m] != blk[k]->buf; m++)
				;
			if (j >= made || d[j].r < 0 || m < n) {
				dd_bm_release(blk[k]);
				continue;
			}
			marked[n++] = blk[k]->buf;
			dd_bm_release_dirty(blk[k]);
		}
		dd_bm_release(&h[j].fpl);
	}
}

/*
 * Make the shares @h holds for @d[0..nr), in order, under one hold of
 * md->change_lock, and let the leaves go. Returns how many were made,
 * each with its result in d[j].r, up to and including the first that
 * ends a call of dd_md_map_duplicates (a free, an error); a share whose
 * entries moved since they were held (-EAGAIN) is not counted, and takes
 * the exclusive path.
 */
static unsigned int dd_share_run(struct dd_metadata *md, struct dd_md_dup *d,
				 struct dd_share_held *h, unsigned int nr,
				 struct dd_md_freed *freed)
{
	unsigned int j;
	int r;

	lockdep_assert_held_read(&md->lock);
	if (!nr)
		return 0;
	mutex_lock(&md->change_lock);
	for (j = 0; j < nr; j++) {
		r = dd_remap_in_place(md, d[j].lba, d[j].pba + 1, &h[j].ip,
				      freed);
		if (r == -EAGAIN)
			break;
		d[j].r = r;
		if (r >= 0)
			dd_count_in_place(md, &md->duplicate_writes);
		if (dd_dup_ends_run(r)) {
			j++;
			break;
		}
	}
	mutex_unlock(&md->change_lock);
	dd_share_release(h, d, nr, j);
	return j;
}

/*
 * dd_map_zero with md->lock held shared: over an unmapped block only the
 * count changes; over a mapped one, in place when its leaves are fresh.
 * -EAGAIN: the exclusive path.
 */
static int dd_zero_in_place(struct dd_metadata *md, u64 lba,
			    struct dd_md_freed *freed)
{
	struct dd_in_place ip = { };
	u64 pba;
	int r;

	lockdep_assert_held_read(&md->lock);
	if (dd_in_place_refused(md))
		return -EAGAIN;
	r = dd_map_entry(md, lba, &pba, false);
	if (r == -ENODATA) {
		mutex_lock(&md->change_lock);
		WRITE_ONCE(md->dirty, true);
		dd_count_in_place(md, &md->zero_writes);
		mutex_unlock(&md->change_lock);
		return 0;
	}
	if (r)
		return r;
	r = dd_hold_in_place(md, lba, 0, &ip);
	if (r)
		return r;
	return dd_change_in_place(md, lba, 0, &ip, &md->zero_writes, freed);
}

/*
 * dd_map_new with md->lock held shared, when the map, refcount and
 * fingerprint leaves it changes are fresh. -EAGAIN: the exclusive path.
 */
static int dd_new_in_place(struct dd_metadata *md, const struct dd_md_new *nb,
			   struct dd_md_freed *freed)
{
	struct dd_in_place ip = { .fp = nb->fp, .new_block = true };
	int r;

	lockdep_assert_held_read(&md->lock);
	if (dd_in_place_refused(md))
		return -EAGAIN;
	r = dd_hold_in_place(md, nb->lba, nb->pba + 1, &ip);
	if (r)
		return r;
	return dd_change_in_place(md, nb->lba, nb->pba + 1, &ip,
				  &md->unique_writes, freed);
}

/* Nothing is stored: the block reads back as zeros. */
static int dd_map_zero(struct dd_metadata *md, u64 lba,
		       struct dd_md_freed *freed)
{
	__le64 v;
	int r;

	r = dd_writable_check(md);
	if (!r)
		r = dd_array_lookup(&md->map, lba, &v, false);
	if (r)
		return r;
	md->zero_writes++;
	return v ? dd_set_map(md, lba, 0, freed) : 0;
}

int dd_md_map_new(struct dd_metadata *md, u64 lba, u64 pba, const u8 *fp,
		  struct dd_md_freed *freed)
{
	struct dd_md_new nb = { .lba = lba, .pba = pba, .fp = fp };
	unsigned int done;

	return dd_md_map_new_run(md, &nb, 1, &done, freed);
}

/*
 * The exclusive path of a run of changes, for one change: one whose
 * leaves are not fresh (-EAGAIN in place) takes the lock exclusive for
 * itself alone and downgrades it, so that the changes after it, whose
 * leaves it has just made fresh, go in place beside other writers'
 * changes instead of holding them all out.
 */
static void dd_lock_for_copy(struct dd_metadata *md)
{
	lockdep_assert_held_read(&md->lock);
	up_read(&md->lock);
	down_write(&md->lock);
}

int dd_md_map_new_run(struct dd_metadata *md, const struct dd_md_new *nb,
		      unsigned int nr, unsigned int *done,
		      struct dd_md_freed *freed)
{
	unsigned int i;
	int r = 0;

	down_read(&md->lock);
	for (i = 0; i < nr && !r; i++) {
		r = dd_new_in_place(md, &nb[i], freed);
		if (r != -EAGAIN)
			continue;
		dd_lock_for_copy(md);
		r = dd_map_new(md, nb[i].lba, nb[i].pba, nb[i].fp, freed);
		downgrade_write(&md->lock);
	}
	up_read(&md->lock);
	*done = i;
	return r;
}

int dd_md_map_duplicate(struct dd_metadata *md, u64 lba, u64 pba,
			const u8 *fp, struct dd_md_freed *freed)
{
	int r;

	down_write(&md->lock);
	r = dd_map_duplicate(md, lba, pba, fp, freed);
	up_write(&md->lock);
	return r;
}

void dd_md_map_duplicates(struct dd_metadata *md, struct dd_md_dup *d,
			  unsigned int nr, unsigned int *done,
			  struct dd_md_freed *freed)
{
	struct dd_share_held one, *run = &one;
	unsigned int i = 0, max = min_t(unsigned int, nr, DD_SHARE_RUN);
	unsigned int m, j;
	int r;

	/* Without memory for a run, one share at a time. */
	if (max > 1)
		run = kmalloc_array(max, sizeof(*run), GFP_NOIO);
	if (!run) {
		run = &one;
		max = 1;
	}
	down_read(&md->lock);
	while (i < nr) {
		r = 0;
		for (m = 0; m < max && i + m < nr; m++) {
			r = dd_share_hold(md, &d[i + m], &run[m]);
			if (r)
				break;
		}
		j = dd_share_run(md, d + i, run, m, freed);
		i += j;
		if (j && dd_dup_ends_run(d[i - 1].r))
			break;
		/*
		 * What d[i] found when it was held, or could not be, may be
		 * stale once the shares before it are made (an old block
		 * down to one reference, a count no longer saturated): it
		 * starts the next run, where it is looked at afresh.
		 */
		if (j)
			continue;
		/* d[i] came first: its leaves are not fresh, or moved. */
		if (m)
			r = -EAGAIN;
		if (r == -EAGAIN) {
			dd_lock_for_copy(md);
			r = dd_map_duplicate_in_leaf(md, &d[i], freed);
			downgrade_write(&md->lock);
		}
		d[i++].r = r;
		if (dd_dup_ends_run(r))
			break;
	}
	up_read(&md->lock);
	if (run != &one)
		kfree(run);
	*done = i;
}

int dd_md_map_zero(struct dd_metadata *md, u64 lba, struct dd_md_freed *freed)
{
	int r;

	down_read(&md->lock);
	r = dd_zero_in_place(md, lba, freed);
	up_read(&md->lock);
	if (r != -EAGAIN)
		return r;
	down_write(&md->lock);
	r = dd_map_zero(md, lba, freed);
	up_write(&md->lock);
	return r;
}

/* Discard / write zeroes. */
static int dd_unmap_range(struct dd_metadata *md, u64 begin, u64 end,
			  struct dd_md_freed *freed, unsigned int max_freed,
			  unsigned int *nr_freed, u64 *next, u64 *unmapped)
{
	u32 per_leaf = md->map.per_leaf;
	u64 leaf_nr = div_u64(begin, per_leaf);
	u64 end_leaf = div_u64(end + per_leaf - 1, per_leaf);
	const __le64 *entries = md->leaf_buf;
	u64 lo, hi, i;
	int r;

	*nr_freed = 0;
	*next = begin;
	r = dd_writable_check(md);
	if (r)
		return r;
	if (end > md->cfg.logical_blocks || begin > end)
		return -ERANGE;
	if (WARN_ON_ONCE(!max_freed))
		return -EINVAL;
	for (; (r = dd_array_next_leaf(&md->map, &leaf_nr, end_leaf)) == 0;
	     leaf_nr++) {
		r = dd_array_read_leaf(&md->map, leaf_nr, md->leaf_buf);
		if (r)
			return r;
		lo = max(begin, leaf_nr * per_leaf);
		hi = min(end, (leaf_nr + 1) * per_leaf);
		for (i = lo; i < hi; i++) {
			if (!entries[i - leaf_nr * per_leaf])
				continue;
			*next = i;
			r = dd_set_map(md, i, 0, &freed[*nr_freed]);
			if (r < 0)
				return r;
			(*unmapped)++;
			md->discarded++;
			if (r && ++*nr_freed == max_freed) {
				/* The caller's array is full: resume after @i. */
				*next = i + 1;
				return 0;
			}
		}
		cond_resched();
	}
	if (r != -ENODATA)
		return r;
	*next = end;
	return 0;
}

int dd_md_unmap_range(struct dd_metadata *md, u64 begin, u64 end,
		      struct dd_md_freed *freed, unsigned int max_freed,
		      unsigned int *nr_freed, u64 *next, u64 *unmapped)
{
	int r;

	down_write(&md->lock);
	r = dd_unmap_range(md, begin, end, freed, max_freed, nr_freed, next,
			   unmapped);
	up_write(&md->lock);
	return r;
}

/* ------------------------------------------------------------------ */
/* commit */

/* One count of the data allocator, read under its lock. */
static u64 dd_data_count(struct dd_metadata *md, const u64 *count)
{
	u64 n;

	mutex_lock(&md->data_lock);
	n = *count;
	mutex_unlock(&md->data_lock);
	return n;
}

/* Exact only while the caller keeps changes out (a commit does). */
bool dd_md_dirty(struct dd_metadata *md)
{
	if (READ_ONCE(md->read_only))
		return false;	/* nothing more is committed, see dd_abort() */
	return READ_ONCE(md->dirty) || dd_data_count(md, &md->data.nr_cooling);
}

/*
 * Non-zero when a block of the running transaction was lost by background
 * writeback: the caller aborts. Cheap unless dm-bufio wrote on its own.
 * The lock is held shared: that keeps commits (and an abort) out, and
 * other writers may go on changing blocks meanwhile, as they do during
 * a commit's write-ahead (a block changed while it is written is dirty
 * again and written again).
 */
int dd_md_writeback_error(struct dd_metadata *md)
{
	int r = 0;

	/* The common case, nothing written behind our back, takes no lock. */
	if (!dd_bm_background_writes(md->bm))
		return 0;
	down_read(&md->lock);
	if (!md->read_only && !md->aborted)
		r = dd_bm_writeback_error(md->bm);
	up_read(&md->lock);
	return r;
}

/*
 * Make the running transaction the committed state: every changed block
 * goes to disk and is flushed, then the superblock names the new roots.
 * The caller flushed the data device first, so the data the new state
 * points at is stable before the state itself.
 */
static void dd_abort(struct dd_metadata *md);

/*
 * Every block of the running transaction, then the superblock naming
 * it (and the save at @saved_root, if any): the transaction becomes the
 * committed state, or it is aborted.
 */
static int dd_write_state(struct dd_metadata *md, u64 saved_root,
			  u64 saved_words)
{
	struct dd_superblock sb;
	int r;

	lockdep_assert_held_write(&md->lock);
	r = dd_bm_write_all(md->bm);
	if (!r) {
		dd_fill_sb(md, &sb);
		sb.saved_root = cpu_to_le64(saved_root);
		sb.saved_words = cpu_to_le64(saved_words);
		r = dd_bm_write_super(md->bm, &sb);
	}
	if (r) {
		dd_abort(md);
		return r;
	}
	md->sb = sb;
	dd_counters(md, md->durable_counters);
	if (md->journaled)
		dd_journal_checkpointed(&md->jnl, le64_to_cpu(sb.journal_seq),
					le64_to_cpu(sb.journal_id),
					le32_to_cpu(sb.flags) & DD_SB_UNFLUSHED_APPENDS);
	md->checkpoints++;
	dd_bm_next_txn(md->bm);
	return 0;
}

void dd_md_write_ahead(struct dd_metadata *md)
{
	/* Read-only metadata is never committed again. */
	if (!READ_ONCE(md->read_only))
		dd_bm_write_ahead(md->bm);
}

int dd_md_commit(struct dd_metadata *md, dd_reusable_fn reusable, void *ctx)
{
	u64 before;
	int r = 0;

	down_write(&md->lock);
	if (md->read_only) {
		r = -EROFS;
		goto out;
	}
	/* nr_cooling changes only here, under md->lock held exclusive. */
	if (!md->dirty && !md->data.nr_cooling)
		goto out;
	r = dd_write_state(md, 0, 0);
	if (r)
		goto out;
	md->dirty = false;
	dd_space_commit(&md->bm->space, NULL, NULL);
	mutex_lock(&md->data_lock);
	before = dd_space_free_blocks(&md->data);
	dd_space_commit(&md->data, reusable, ctx);
	dd_data_gained(md, before);
	mutex_unlock(&md->data_lock);
out:
	up_write(&md->lock);
	return r;
}

bool dd_md_journaled(struct dd_metadata *md)
{
	return md->journaled;
}

int dd_md_journal_take(struct dd_metadata *md, struct dd_journal_batch *b)
{
	u64 counters[DD_JR_NR_COUNTERS];
	int r;

	down_write(&md->lock);
	r = -EROFS;
	if (md->read_only)
		goto out;
	r = -ENOSPC;
	if (!md->journaled)
		goto out;
	dd_counters(md, counters);
	r = dd_journal_take(&md->jnl, counters,
			    memcmp(counters, md->durable_counters,
				   sizeof(counters)) != 0,
			    md->bm->txn, b);
	if (!r)
		memcpy(md->durable_counters, counters, sizeof(counters));
out:
	up_write(&md->lock);
	return r;
}

int dd_md_journal_write(struct dd_metadata *md, struct dd_journal_batch *b)
{
	return dd_journal_write(&md->jnl, b);
}

void dd_md_journal_drop(struct dd_metadata *md, struct dd_journal_batch *b)
{
	dd_journal_drop_batch(&md->jnl, b);
}

void dd_md_journal_data_stable(struct dd_metadata *md)
{
	if (md->journaled)
		dd_journal_data_stable(&md->jnl);
}

bool dd_md_journal_pending(struct dd_metadata *md)
{
	u64 c[DD_JR_NR_COUNTERS];
	bool moved;

	if (!md->journaled)
		return false;
	if (dd_journal_pending(&md->jnl))
		return true;
	/* A change that moved only a count: a zero block over an unmapped one. */
	down_read(&md->lock);
	mutex_lock(&md->change_lock);
	dd_counters(md, c);
	moved = memcmp(c, md->durable_counters, sizeof(c)) != 0;
	mutex_unlock(&md->change_lock);
	up_read(&md->lock);
	return moved;
}

bool dd_md_checkpoint_due(struct dd_metadata *md)
{
	return md->journaled &&
	       dd_journal_used(&md->jnl) >=
			le64_to_cpu(md->sb.journal_blocks) / 2;
}

/*
 * Frees a commit held (cfg->hold_frees) become free, each run after
 * @reusable has seen it with no lock held: it may discard the run and
 * wait for that. Called by one thread at a time, after the commit.
 */
void dd_md_release_held(struct dd_metadata *md, dd_reusable_fn reusable,
			void *ctx)
{
	u64 begin = 0, end, before;
	bool found;

	for (;;) {
		mutex_lock(&md->data_lock);
		found = dd_space_held_run(&md->data, begin, &begin, &end);
		mutex_unlock(&md->data_lock);
		if (!found)
			return;
		if (reusable)
			reusable(ctx, begin, end);
		mutex_lock(&md->data_lock);
		before = dd_space_free_blocks(&md->data);
		dd_space_release_held(&md->data, begin, end);
		dd_data_gained(md, before);
		mutex_unlock(&md->data_lock);
		begin = end;
		cond_resched();
	}
}

/*
 * After an abort, a block of the newest append whose data cannot be read
 * counts as missing, and the append is dropped: its data flush had not
 * been seen to succeed (dd_journal_unchecked), and an error would drop
 * every append before it as well, which flush requests saw durable. An
 * activation, which keeps what it decides, refuses instead. Only that
 * append is checked: if it never reached the journal whole, the last
 * whole one there is an acknowledged append, applied as it is.
 */
static int dd_abort_verify(void *ctx, u64 pba, const u8 *fp)
{
	struct dd_metadata *md = ctx;
	int r = md->cfg.verify(md->cfg.ctx, pba, fp);

	if (r < 0)
		DMERR("%s: journal: data block %llu unreadable (%d): newest append dropped",
		      dd_md_name(md), pba, r);
	return r < 0 ? 1 : r;
}

/*
 * A change or a commit failed: from now on lookups see the last committed
 * state, exactly what a crash would leave, and nothing changes any more.
 * Its blocks are intact on disk; the running transaction's are not, and
 * dm-bufio drops a cached block whose write failed. The dead transaction's
 * dirty blocks are written out now, onto blocks the last commit leaves
 * free, while this instance still owns the device: later, when a reloaded
 * table may already allocate those blocks, nothing of it is left to write.
 */
static void dd_abort(struct dd_metadata *md)
{
	const struct dd_superblock *sb = &md->sb;
	u64 seq;

	lockdep_assert_held_write(&md->lock);
	/* A failed commit aborts, then its caller does: once is enough. */
	if (md->aborted)
		return;
	md->aborted = true;
	WRITE_ONCE(md->read_only, true);
	md->dirty = false;
	md->map.root = le64_to_cpu(sb->map_root);
	md->refcount.root = le64_to_cpu(sb->refcount_root);
	md->fingerprint.root = le64_to_cpu(sb->fingerprint_root);
	dd_load_committed_counters(md);
	dd_bm_settle(md->bm);
	/*
	 * What flushes made durable since the last commit reads back. The
	 * newest append needs its data checked only if its flush may not
	 * have completed: an acknowledged append must not be lost to a
	 * data device that fails its reads now.
	 */
	if (!md->journaled || !dd_journal_used(&md->jnl))
		return;
	if (dd_replay_overlay(md, dd_journal_unchecked(&md->jnl, &seq) ?
			      dd_abort_verify : NULL, md, &seq))
		DMERR("%s: journal unreadable after the abort: reads show the last commit",
		      dd_md_name(md));
	else
		dd_replay_dropped(md);
}

void dd_md_abort(struct dd_metadata *md)
{
	down_write(&md->lock);
	dd_abort(md);
	up_write(&md->lock);
}

/*
 * The flag goes into the last commit's superblock, written as the next
 * generation: its trees are that commit's, so whichever slot a later
 * open picks holds the same state, and the other slot's older state
 * stays a fallback as after any commit.
 */
int dd_md_flag_needs_check(struct dd_metadata *md)
{
	struct dd_superblock sb;
	u64 txn;
	int r;

	down_write(&md->lock);
	dd_abort(md);
	txn = le64_to_cpu(md->sb.hdr.txn) + 1;
	if (md->needs_check || md->cfg.read_only || txn > DD_MAX_TXN) {
		r = md->needs_check;
		goto out;
	}
	sb = md->sb;
	sb.flags |= cpu_to_le32(DD_SB_NEEDS_CHECK);
	/* Damaged metadata is walked at the next open, never loaded. */
	sb.saved_root = 0;
	sb.saved_words = 0;
	sb.hdr.txn = cpu_to_le64(txn);
	r = dd_bm_write_super(md->bm, &sb);
	if (!r) {
		md->sb = sb;
		md->needs_check = true;
		r = 1;
	}
out:
	up_write(&md->lock);
	return r;
}

int dd_md_save(struct dd_metadata *md, const struct dd_md_saved *saved)
{
	u64 root, words;
	int r;

	down_write(&md->lock);
	r = -EROFS;
	if (md->read_only)
		goto out;
	r = -EBUSY;
	if (md->dirty)
		goto out;
	r = -EOVERFLOW;
	if (md->bm->txn > DD_MAX_TXN)
		goto out;
	mutex_lock(&md->data_lock);
	/* The save describes the blocks in use, not those held for writers. */
	dd_reserve_return(md);
	r = dd_saved_write(md->bm, &md->data, saved, md->leaf_buf, &root,
			   &words);
	mutex_unlock(&md->data_lock);
	if (r) {
		/* Its blocks are free for the last commit: write them out. */
		dd_abort(md);
		goto out;
	}
	r = dd_write_state(md, root, words);
	if (r)
		goto out;
	/* The save describes this state: nothing may change it now. */
	WRITE_ONCE(md->read_only, true);
out:
	up_write(&md->lock);
	return r;
}

bool dd_md_needs_check(struct dd_metadata *md)
{
	bool r;

	down_read(&md->lock);
	r = md->needs_check;
	up_read(&md->lock);
	return r;
}

void dd_md_stats(struct dd_metadata *md, struct dd_md_stats *st)
{
	down_read(&md->lock);
	st->transaction_id = le64_to_cpu(md->sb.hdr.txn);
	st->metadata_used = md->bm->space.nr_used;
	st->metadata_total = md->bm->nr_blocks;
	mutex_lock(&md->data_lock);
	st->data_used = md->data.nr_blocks - dd_md_free_data_blocks(md);
	st->data_total = md->data.nr_blocks;
	st->data_space_bytes = dd_space_bytes(&md->data);
	st->pending_free = dd_space_frees_to_come(&md->data);
	mutex_unlock(&md->data_lock);
	mutex_lock(&md->change_lock);
	st->data_live = md->live;
	st->mapped = md->mapped;
	st->unique_writes = md->unique_writes;
	st->duplicate_writes = md->duplicate_writes;
	st->in_place_changes = md->in_place_changes;
	st->zero_writes = md->zero_writes;
	st->discarded = md->discarded;
	mutex_unlock(&md->change_lock);
	st->checkpoints = md->checkpoints;
	st->journal_used = 0;
	st->journal_appends = 0;
	st->journal_blocks_written = 0;
	if (md->journaled)
		dd_journal_stats(&md->jnl, &st->journal_used,
				 &st->journal_appends,
				 &st->journal_blocks_written);
	st->journal_total = le64_to_cpu(md->sb.journal_blocks);
	st->journal_replayed = md->replayed.blocks;
	st->journal_dropped = md->replayed.dropped;
	up_read(&md->lock);
}

u64 dd_md_free_data_blocks(struct dd_metadata *md)
{
	/*
	 * Promised blocks are still free on the device. A promise made or
	 * given back moves a block between the two counts in two steps:
	 * the sum may be one promise off meanwhile.
	 */
	s64 n = atomic64_read(&md->data_free) +
		atomic64_read(&md->data_promised);

	return clamp_t(s64, n, 0, md->data.nr_blocks);
}

u64 dd_md_data_reusable_at_commit(struct dd_metadata *md)
{
	return dd_data_count(md, &md->data.nr_cooling);
}

u64 dd_md_pending_data_frees(struct dd_metadata *md)
{
	return dd_data_count(md, &md->data.nr_pending);
}
