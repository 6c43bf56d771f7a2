// SPDX-License-Identifier: GPL-2.0-only
/*
 * The dedup decision: for a hashed block, share a live block with the same
 * content or store a new one, and every metadata change a bio makes. Owns
 * the fingerprint index and the table of unique writes in flight, both
 * under dc->index_lock. Writers decide concurrently, each holding the
 * transaction lock (dc->lock) shared; each metadata verb is atomic on its
 * own (dedup-metadata.c), so a block found in the index may die before it
 * is shared, which the sharing verb reports as a soft miss.
 */
#define DM_MSG_PREFIX "dedup"

#include <linux/blkdev.h>
#include <linux/stringify.h>
#include <linux/unaligned.h>

#include "dedup-target.h"

/* Candidate leaves taken per trip through dc->index_lock. */
#define DD_CANDIDATES			8
/* Live blocks of one content in one fingerprint leaf, looked at. */
#define DD_HOLDERS			4
/* Candidate leaves ruled out, at most, before a copy is stored anyway. */
#define DD_RULED_OUT_MAX		16
/*
 * Candidates compared byte for byte before storing a copy: with a short
 * hash, somebody may have planted a colliding block in front of the real
 * duplicate.
 */
#define DD_VERIFY_CANDIDATES		8
/*
 * Times a write looks at ruled-out leaves again because a leader of its
 * content may have landed in one meanwhile, before it stores a copy.
 */
#define DD_LOOK_AGAIN			4
/* New blocks mapped per trip through the metadata lock. */
#define DD_MAP_BATCH			16
/* Logical blocks a discard unmaps per trip through the locks. */
#define DD_UNMAP_CHUNK			1024

void dd_decide_init(struct dedup_c *dc)
{
	spin_lock_init(&dc->index_lock);
	hash_init(dc->inflight);
}

/* ------------------------------------------------------------------ */
/* the index */

/* Each live block, while the metadata is opened (no lock: not yet live). */
int dd_index_visit(void *ctx, u64 pba, const u8 *fp)
{
	struct dedup_c *dc = ctx;
	int r = dd_index_insert(&dc->index, fp, pba);

	if (r == -ENOSPC) {
		atomic64_inc(&dc->index_full);
		return 0;	/* stays readable, just not a dedup target */
	}
	return r;
}

/*
 * The index as the metadata saves it at a clean close and loads it at
 * the next open (struct dd_md_saved). head[0] names this layout: the
 * packed entries as dedup-index.c keeps them, keyed by head[1..2], in
 * the geometry of head[6..7].
 */
#define DD_INDEX_SAVED_LAYOUT	0x32584449	/* "IDX2" */
enum dd_index_head {
	DD_HEAD_LAYOUT,
	DD_HEAD_KEY0,
	DD_HEAD_KEY1,
	DD_HEAD_ENTRIES,
	DD_HEAD_FULL,		/* failed inserts so far, the stats counter */
	DD_HEAD_LOADS,		/* activations that loaded it since a walk */
	DD_HEAD_GEOMETRY,	/* dd_index_geometry() */
	DD_HEAD_BUCKETS,
};

/*
 * A load trusts what the last instance had in RAM; a walk checks the
 * trees and draws a new placement key. Every so many loads, walk.
 */
#define DD_INDEX_MAX_LOADS	16
const char dd_index_walk_due[] =
	"loaded " __stringify(DD_INDEX_MAX_LOADS)
	" times since the last walk: walking to check the trees and draw a new index key";

void dd_index_saved_view(struct dedup_c *dc, struct dd_md_saved *s)
{
	memset(s, 0, sizeof(*s));
	s->words = dc->index.words;
	s->nr_words = dc->index.nr_words;
	s->head[DD_HEAD_LAYOUT] = DD_INDEX_SAVED_LAYOUT;
	s->head[DD_HEAD_KEY0] = dc->index.key.key[0];
	s->head[DD_HEAD_KEY1] = dc->index.key.key[1];
	s->head[DD_HEAD_ENTRIES] = dc->index.nr_entries;
	s->head[DD_HEAD_FULL] = atomic64_read(&dc->index_full);
	s->head[DD_HEAD_LOADS] = dc->index_loads;
	s->head[DD_HEAD_GEOMETRY] = dd_index_geometry(&dc->index);
	s->head[DD_HEAD_BUCKETS] = dc->index.nr_buckets;
}

/* Does fingerprint leaf @leaf hold the record of a live block? */
static bool dd_leaf_live(const struct dd_space *live, u64 leaf)
{
	return dd_space_any_used(live, leaf * DD_FP_PER_LEAF,
				 (leaf + 1) * DD_FP_PER_LEAF);
}

/*
 * Before the metadata accepts a loaded index (loaded into its words):
 * every entry names a leaf with a live block, and the counts agree.
 */
int dd_index_saved_ok(void *ctx, const struct dd_md_saved *s,
		      const struct dd_space *live, const char **why)
{
	struct dedup_c *dc = ctx;
	u64 i, n = 0, leaf;
	int r;

	if (s->head[DD_HEAD_LOADS] >= DD_INDEX_MAX_LOADS) {
		*why = dd_index_walk_due;
		return -EAGAIN;
	}
	if (s->head[DD_HEAD_GEOMETRY] != dd_index_geometry(&dc->index) ||
	    s->head[DD_HEAD_BUCKETS] != dc->index.nr_buckets) {
		*why = "saved with another index geometry";
		return -ESTALE;
	}
	for (i = 0; i < dd_index_nr_slots(&dc->index); i++) {
		if (!(i & 0xfffff))
			cond_resched();
		r = dd_index_slot_leaf(&dc->index, i, &leaf);
		if (!r)
			continue;
		if (r < 0) {
			*why = "an index entry is malformed";
			return r;
		}
		if (!dd_leaf_live(live, leaf)) {
			*why = "an index entry names a leaf without live blocks";
			return -EILSEQ;
		}
		n++;
	}
	if (n != s->head[DD_HEAD_ENTRIES] || n > dc->index.max_entries ||
	    n > live->nr_used) {
		*why = "the index's entry count disagrees";
		return -EILSEQ;
	}
	return 0;
}

/* After an open that loaded the index into its slots: the rest of it. */
void dd_index_saved_adopt(struct dedup_c *dc, const struct dd_md_saved *s)
{
	dc->index.key.key[0] = s->head[DD_HEAD_KEY0];
	dc->index.key.key[1] = s->head[DD_HEAD_KEY1];
	dc->index.nr_entries = s->head[DD_HEAD_ENTRIES];
	atomic64_set(&dc->index_full, s->head[DD_HEAD_FULL]);
	dc->index_loads = s->head[DD_HEAD_LOADS] + 1;
}

/* Only content on disk may be shared: called once its write completed. */
static void dd_index_add(struct dedup_c *dc, const u8 *fp, u64 pba)
{
	lockdep_assert_held(&dc->index_lock);
	if (dd_index_insert(&dc->index, fp, pba))
		atomic64_inc(&dc->index_full);
}

/*
 * Blocks a change freed leave the index before the transaction lock is
 * dropped, so before the commit that lets them be reused.
 */
static void dd_index_forget(struct dedup_c *dc, const struct dd_md_freed *f,
			    unsigned int nr)
{
	lockdep_assert_held_read(&dc->lock);
	spin_lock(&dc->index_lock);
	while (nr--)
		dd_index_remove(&dc->index, f[nr].fp, f[nr].pba);
	spin_unlock(&dc->index_lock);
}

/*
 * A failed change may be half done: nothing more may be committed. Once
 * one failed, the metadata is closed and the rest fail with EROFS, which
 * the first failure already reported.
 */
static void dd_change_failed(struct dedup_c *dc, const char *what, int r)
{
	if (r != -EROFS)
		dd_metadata_error(dc, what, r);
}

/* A change's result: 1 means it freed a block, which leaves the index. */
static int dd_changed(struct dedup_c *dc, int r, const struct dd_md_freed *f)
{
	if (r == 1)
		dd_index_forget(dc, f, 1);
	return r < 0 ? r : 0;
}

static bool dd_u64_in(u64 v, const u64 *set, unsigned int nr)
{
	while (nr--)
		if (set[nr] == v)
			return true;
	return false;
}

/*
 * Up to @max fingerprint leaves the index names for @fp, each once,
 * leaving out the @nr_skip in @skip. The index only narrows the search;
 * the persistent records in the leaf decide, read after the lock is
 * dropped.
 */
static unsigned int dd_index_candidates(struct dedup_c *dc, const u8 *fp,
					const u64 *skip, unsigned int nr_skip,
					u64 *out, unsigned int max)
{
	struct dd_index_iter it;
	unsigned int nr = 0;
	u64 leaf;

	lockdep_assert_held(&dc->index_lock);
	dd_index_iter_init(&dc->index, fp, &it);
	while (nr < max && dd_index_iter_next(&dc->index, &it, &leaf))
		if (!dd_u64_in(leaf, skip, nr_skip) && !dd_u64_in(leaf, out, nr))
			out[nr++] = leaf;
	return nr;
}

/* ------------------------------------------------------------------ */
/* unique writes in flight */

static u32 dd_inflight_key(const u8 *fp)
{
	return get_unaligned_le32(fp);
}

/* How many leaders of content hashing like @fp's have left the table. */
static u32 *dd_inflight_ends(struct dedup_c *dc, const u8 *fp)
{
	lockdep_assert_held(&dc->index_lock);
	return &dc->inflight_ends[hash_min(dd_inflight_key(fp),
					   DD_INFLIGHT_BITS)];
}

static struct dd_write_block *dd_inflight_find(struct dedup_c *dc, const u8 *fp)
{
	struct dd_write_block *b;

	lockdep_assert_held(&dc->index_lock);
	hash_for_each_possible(dc->inflight, b, inflight_node,
			       dd_inflight_key(fp))
		if (!memcmp(b->fp, fp, DD_FP_SIZE))
			return b;
	return NULL;
}

static void dd_inflight_add(struct dedup_c *dc, struct dd_write_block *b)
{
	lockdep_assert_held(&dc->index_lock);
	INIT_LIST_HEAD(&b->waiters);
	hash_add(dc->inflight, &b->inflight_node, dd_inflight_key(b->fp));
}

/* From now on no writer parks behind @b: its waiters are its own. */
static void dd_inflight_leave(struct dedup_c *dc, struct dd_write_block *b)
{
	lockdep_assert_held(&dc->index_lock);
	hash_del(&b->inflight_node);
	(*dd_inflight_ends(dc, b->fp))++;
}

/*
 * @b's data was stored and mapped: under verify, each writer of the same
 * content waiting behind it is compared with @b's data here, both pages
 * in memory, before that page is kept or let go. A copy of a block whose
 * own write was still in flight then shares it without a read. (fio
 * repeats buffers that are still in flight; read one block at a time,
 * they cost a sequential copy most of its speed.)
 */
static void dd_inflight_twins(struct dedup_c *dc, struct dd_write_block *b)
{
	struct dd_write_block *waiter;

	/* What reuse_seq is worth: the lock holds it still. */
	lockdep_assert_held_read(&dc->lock);
	if (!dc->verify)
		return;
	list_for_each_entry(waiter, &b->waiters, wait_entry) {
		if (dd_data_equal(waiter->data, b->data)) {
			waiter->twin = b->pba + 1;
			waiter->twin_seq = dc->reuse_seq;
		}
	}
}

/*
 * Writers of the same content as @b, which left the table, decide again,
 * now against the index. No writer joins @b->waiters any more.
 */
static void dd_inflight_wake(struct dedup_c *dc, struct dd_write_block *b)
{
	struct dd_write_block *waiter, *tmp;

	/* Their work is the block's own (dedup-io.c): it decides again. */
	list_for_each_entry_safe(waiter, tmp, &b->waiters, wait_entry) {
		list_del_init(&waiter->wait_entry);
		queue_work(dc->wq, &waiter->work);
	}
}

/* PBA + 1 of a block equal to @b's data in memory, if still good; or 0. */
static u64 dd_twin(struct dedup_c *dc, struct dd_write_block *b)
{
	u64 twin = b->twin;

	lockdep_assert_held_read(&dc->lock);
	b->twin = 0;
	return twin && b->twin_seq == dc->reuse_seq ? twin : 0;
}

/*
 * No live block holds @b's content: store it, or wait behind the write
 * already storing it. Called in the same hold of dc->index_lock as the
 * lookup that found no candidate, so two writers of new content never
 * both store it.
 */
static enum dd_decision dd_lead_or_park(struct dedup_c *dc,
					struct dd_write_block *b)
{
	struct dd_write_block *leader;

	lockdep_assert_held(&dc->index_lock);
	b->error = 0;
	/* Never share a block before its data is written. */
	leader = dd_inflight_find(dc, b->fp);
	if (leader) {
		list_add_tail(&b->wait_entry, &leader->waiters);
		return DD_PARKED;
	}
	dd_inflight_add(dc, b);
	return DD_STORE;
}

/* A leader that will not store after all: its followers decide again. */
static void dd_inflight_cancel(struct dedup_c *dc, struct dd_write_block *b)
{
	spin_lock(&dc->index_lock);
	dd_inflight_leave(dc, b);
	spin_unlock(&dc->index_lock);
	dd_inflight_wake(dc, b);
}

/* ------------------------------------------------------------------ */
/* the decision */

/*
 * Does physical block @pba hold exactly the write's data, as long as
 * dc->reuse_seq is @seq?
 */
static int dd_same_content(struct dedup_c *dc, struct dd_write_block *b,
			   u64 pba, u64 seq)
{
	struct dd_data_owner owner;
	struct page *page;
	int r;

	switch (dd_data_stored_compare(&dc->data_pool, pba, seq, b->data)) {
	case DD_KEPT_SAME:
		return 1;
	case DD_KEPT_DIFFERENT:
		return 0;
	case DD_KEPT_NONE:
		break;
	}
	/* Short of memory, store a copy rather than wait for memory. */
	page = alloc_page(GFP_NOIO | __GFP_NORETRY | __GFP_NOWARN);
	if (!page)
		return -ENOMEM;
	atomic64_inc(&dc->verify_reads);
	dd_write_owner(b->w, &owner);
	r = dd_data_read_block(dc->data_dev->bdev, pba, page, &owner);
	if (!r)
		r = dd_data_equal(page, b->data);
	__free_page(page);
	return r;
}

enum dd_share_result {
	DD_SHARED,	/* @lba now maps the candidate */
	DD_RULED_OUT,	/* other content, or the block died meanwhile */
	DD_DIFFERENT,	/* verify found other bytes under the same fingerprint */
	DD_COPY,	/* the same content, but store a copy of our own */
};

/* Reads of one candidate that commits may cut short, at most. */
#define DD_VERIFY_READS	4

/* Share candidate @pba if it holds the write's content; < 0 on error. */
static int dd_share(struct dedup_c *dc, struct dd_write_block *b, u64 pba)
{
	unsigned int reads = 0;
	struct dd_md_freed freed;
	int r;

	lockdep_assert_held_read(&dc->lock);
	while (dc->verify) {
		/*
		 * Only a block live with our fingerprint is worth reading. A
		 * live block's content never changes, and a freed one is reused
		 * only after a commit that reuses. The read is made without
		 * the lock, so that it never holds up a commit and the writers
		 * queued behind it; if no such commit ran meanwhile, what was
		 * read is what the block holds, as long as the share below
		 * finds it still live.
		 * (Without verify the share checks alone, in one trip through
		 * the metadata lock: mixing shared and exclusive trips makes
		 * writers queue behind each other.)
		 */
		u64 seq = dc->reuse_seq;

		r = dd_md_holds(dc->md, pba, b->fp);
		if (r <= 0)
			return r ? r : DD_RULED_OUT;
		up_read(&dc->lock);
		r = dd_same_content(dc, b, pba, seq);
		down_read(&dc->lock);
		if (dc->reuse_seq != seq) {
			/*
			 * The block may have been reused: read it again, but
			 * not for ever while commits keep coming (a flush
			 * commits each time without a journal): a copy of our
			 * own ends the wait.
			 */
			if (++reads == DD_VERIFY_READS)
				return DD_COPY;
			continue;
		}
		if (r < 0)
			return DD_COPY;	/* unreadable: store a copy of its own */
		if (!r) {
			atomic64_inc(&dc->verify_mismatches);
			return DD_DIFFERENT;
		}
		break;
	}
	r = dd_md_map_duplicate(dc->md, b->lba, pba, b->fp, &freed);
	if (r == -EOVERFLOW)
		return DD_COPY;	/* refcount saturated */
	if (r == -ENOENT)
		return DD_RULED_OUT;	/* its last reference went meanwhile */
	r = dd_changed(dc, r, &freed);
	return r ? r : DD_SHARED;
}

/*
 * Share a live block with the same content (DD_DONE, b->error says how
 * it went), or else become the write that stores this content (DD_STORE)
 * or wait for the one that does (DD_PARKED).
 */
static int dd_try_dedup(struct dedup_c *dc, struct dd_write_block *b)
{
	u64 cand[DD_CANDIDATES], out[DD_RULED_OUT_MAX], pba[DD_HOLDERS];
	unsigned int nr, i, nr_out = 0, nr_differ = 0, again = 0;
	bool copy = false;
	u32 ends = 0, *ends_now;
	int r, n, j;

	lockdep_assert_held_read(&dc->lock);
	for (;;) {
		spin_lock(&dc->index_lock);
		ends_now = dd_inflight_ends(dc, b->fp);
		/* Before any leaf is ruled out: what a leaf reads from here on. */
		if (!nr_out)
			ends = *ends_now;
		nr = copy ? 0 : dd_index_candidates(dc, b->fp, out, nr_out,
						    cand, DD_CANDIDATES);
		/*
		 * A leader enters the index before it is mapped: a leaf ruled
		 * out for holding no live block of our content may hold the
		 * leader's block by now, and the leader has left the table.
		 * Look at every leaf again rather than store a second copy.
		 */
		if (!nr && nr_out && !copy && again < DD_LOOK_AGAIN &&
		    *ends_now != ends) {
			again++;
			nr_out = 0;
			spin_unlock(&dc->index_lock);
			continue;
		}
		if (!nr) {
			r = dd_lead_or_park(dc, b);
			spin_unlock(&dc->index_lock);
			return r;
		}
		spin_unlock(&dc->index_lock);

		/*
		 * A leaf ruled out stays out for this write, even if a block
		 * with this content lands in it meanwhile: that costs a
		 * copy, never a wrong share.
		 */
		for (i = 0; i < nr && !copy; i++) {
			n = dd_md_find_holders(dc->md, cand[i], b->fp, pba,
					       ARRAY_SIZE(pba));
			if (n < 0)
				return n;
			atomic64_inc(&dc->index_candidates);
			if (!n)
				atomic64_inc(&dc->index_false_candidates);
			for (j = 0; j < n && !copy; j++) {
				r = dd_share(dc, b, pba[j]);
				if (r < 0)
					return r;
				if (r == DD_SHARED)
					return DD_DONE;
				if (r == DD_DIFFERENT &&
				    ++nr_differ == DD_VERIFY_CANDIDATES)
					r = DD_COPY;
				copy = r == DD_COPY;
			}
			if (nr_out == DD_RULED_OUT_MAX)
				copy = true;
			else
				out[nr_out++] = cand[i];
		}
	}
}

/*
 * One block, under the transaction lock: a zero block is mapped, a
 * duplicate shared (DD_DONE, with b->error), new content joins the
 * in-flight table and still needs a block for its data (DD_STORE), and a
 * twin of content in flight is parked behind it (DD_PARKED).
 */
static enum dd_decision dd_decide_block(struct dedup_c *dc, struct dd_write_block *b)
{
	struct dd_md_freed freed;
	int r;

	lockdep_assert_held_read(&dc->lock);
	b->error = 0;
	if (READ_ONCE(dc->mode) != DD_MODE_RW) {
		b->error = -EIO;
		return DD_DONE;
	}
	if (b->flags & DD_BLOCK_ZERO) {
		r = dd_md_map_zero(dc->md, b->lba, &freed);
		r = dd_changed(dc, r, &freed);
	} else {
		r = dd_try_dedup(dc, b);
		if (r == DD_STORE || r == DD_PARKED)
			return r;
	}
	if (r)
		dd_change_failed(dc, "write", r);
	else
		dd_check_writeback(dc);
	b->error = r;
	return DD_DONE;
}

/*
 * Blocks for the data of the @nr_store new blocks among @blk, as few runs
 * of consecutive physical blocks as the allocator can give, so that their
 * data goes out in as few bios. A block that gets none leaves the
 * in-flight table: it waits for the commit that frees blocks, or fails.
 */
static void dd_give_blocks(struct dedup_c *dc, struct dd_write_block *blk,
			   unsigned int nr, u8 *decision, unsigned int nr_store)
{
	u64 first = 0, len = 0, free_left;
	struct dd_write_block *b;
	bool promised, first_promised = false;
	unsigned int i;
	int r = 0;

	lockdep_assert_held_read(&dc->lock);
	for (i = 0; i < nr; i++) {
		if (decision[i] != DD_STORE)
			continue;
		b = &blk[i];
		/*
		 * The blocks of a write are all promised, or none; a block
		 * decided again is decided alone.
		 */
		promised = b->flags & DD_BLOCK_PROMISED;
		WARN_ON_ONCE(len && promised != first_promised);
		first_promised = promised;
		if (!len && !r) {
			r = dd_md_alloc_data_run(dc->md, nr_store, promised,
						 &first, &len, &free_left);
			if (!r)
				dd_low_water_check(dc, free_left);
		}
		nr_store--;
		if (!r) {
			b->pba = first++;
			b->flags &= ~DD_BLOCK_PROMISED;
			len--;
			continue;
		}
		dd_inflight_cancel(dc, b);
		if (r == -EAGAIN) {
			/*
			 * Freed blocks come back within two commits,
			 * promised ones once their writes are decided.
			 */
			dd_wait_for_frees(dc, b);
			decision[i] = DD_PARKED;
			continue;
		}
		if (r == -ENOSPC)
			atomic64_inc(&dc->nospc_errors);
		b->error = r;
		decision[i] = DD_DONE;
	}
}

/* Not decided yet by dd_share_known(): the block's own steps decide it. */
#define DD_UNDECIDED	0xff

/* What became of @nr shares dd_share_known() tried in one trip. */
static void dd_shared_known(struct dedup_c *dc, struct dd_write_block *blk,
			    u8 *decision, const struct dd_md_dup *d,
			    const u8 *which, unsigned int nr,
			    const struct dd_md_freed *freed)
{
	bool changed = false;
	unsigned int j;
	int r;

	lockdep_assert_held_read(&dc->lock);
	for (j = 0; j < nr; j++) {
		r = d[j].r;
		atomic64_inc(&dc->index_candidates);
		/* With d.only: the block compared died, not a false leaf. */
		if (r == -ENOENT && !d[j].only)
			atomic64_inc(&dc->index_false_candidates);
		if (r == -ENOENT || r == -EOVERFLOW)
			continue;	/* the block's own steps look further */
		/* Only the last can have freed a block. */
		r = dd_changed(dc, r, freed);
		if (r)
			dd_change_failed(dc, "write", r);
		changed |= !r;
		blk[which[j]].error = r;
		decision[which[j]] = DD_DONE;
	}
	if (changed)
		dd_check_writeback(dc);
}

/*
 * The first holder of @b's content, @pba, has other bytes: its copy kept
 * in memory says so (a collision of a short hash). Another holder in the
 * same leaf may have its copy kept too, and be equal: PBA + 1 of that
 * one, or 0, and the block's own steps (dd_try_dedup) compare the rest.
 * Either way, nothing is read here for a holder known to differ. A
 * metadata error here counts as no such holder: the block's own steps
 * search the leaf again and report it.
 */
static noinline u64 dd_kept_other_holder(struct dedup_c *dc,
					 struct dd_write_block *b, u64 pba)
{
	u64 holder[DD_MD_HOLDERS_MAX];
	int i, n;

	lockdep_assert_held_read(&dc->lock);
	n = dd_md_find_holders(dc->md, dd_index_leaf_of(pba), b->fp, holder,
			       ARRAY_SIZE(holder));
	for (i = 0; i < n; i++) {
		if (holder[i] != pba &&
		    dd_data_stored_compare(&dc->data_pool, holder[i],
					   dc->reuse_seq, b->data) == DD_KEPT_SAME)
			return holder[i] + 1;
	}
	return 0;
}

/* What verify compared for the blocks of one write (dd_verify_write). */
struct dd_verified {
	u64 seq;		/* dc->reuse_seq when the reads were made */
	u64 same[DD_BIO_BLOCKS];	/* by block: PBA + 1 of equal bytes, or 0 */
	/* the reads, compacted, and the read each block compares with */
	u64 pba[DD_BIO_BLOCKS];
	struct page *page[DD_BIO_BLOCKS];
	int error[DD_BIO_BLOCKS];
	u8 read[DD_BIO_BLOCKS];
	struct dd_data_reads reads;
};

/*
 * Under verify, before dd_share_known() shares the known blocks of a
 * write: each compared with the first live holder of its content in its
 * first candidate leaf, all read at once without the transaction lock, in
 * disk order (a sequential copy finds its candidates side by side: one
 * read per run). A block its leader woke and found equal needs no read
 * (dd_inflight_twins), nor one whose holder was stored lately and still
 * has its copy in memory (dd_data_keep_stored), equal or not.
 * NULL when none could be compared: no known block, short of memory, or
 * a commit during the reads let freed blocks be reused (dc->reuse_seq,
 * as in dd_share). A block left without an equal holder goes its own
 * steps (dd_try_dedup), which compare its candidates again one at a time
 * (a read each, unless a kept copy answers) and count what differs.
 */
static noinline_for_stack struct dd_verified *
dd_verify_write(struct dedup_c *dc, struct dd_write_block *blk,
		unsigned int nr)
{
	/* by block: its candidate leaf, then its holder */
	u64 at[DD_BIO_BLOCKS];
	const u8 *fp[DD_BIO_BLOCKS];	/* by block: the content to look up */
	bool known[DD_BIO_BLOCKS], any = false, in_memory = false;
	u8 order[DD_BIO_BLOCKS];
	struct dd_data_owner owner;
	struct dd_verified *v;
	unsigned int i, j, k, m = 0, n = 0;

	BUILD_BUG_ON(DD_BIO_BLOCKS > DD_DATA_READS || DD_BIO_BLOCKS >= U8_MAX);
	lockdep_assert_held_read(&dc->lock);
	nr = min_t(unsigned int, nr, DD_BIO_BLOCKS);
	spin_lock(&dc->index_lock);
	for (i = 0; i < nr; i++) {
		known[i] = !(blk[i].flags & DD_BLOCK_ZERO) &&
			   dd_index_candidates(dc, blk[i].fp, NULL, 0, &at[i], 1);
		any |= known[i] || blk[i].twin;
	}
	spin_unlock(&dc->index_lock);
	if (!any)
		return NULL;	/* unique data reads nothing */
	v = kmalloc(sizeof(*v), GFP_NOIO | __GFP_NORETRY | __GFP_NOWARN);
	if (!v)
		return NULL;
	for (i = 0; i < nr; i++) {
		/* Compared in memory when its leader woke it: no read. */
		v->same[i] = dd_twin(dc, &blk[i]);
		v->read[i] = U8_MAX;
		in_memory |= v->same[i];
		fp[i] = known[i] && !v->same[i] ? blk[i].fp : NULL;
	}
	/* Dead records come first too: look past them, all in one trip. */
	dd_md_first_holders(dc->md, at, fp, nr);
	for (i = 0; i < nr; i++) {
		if (at[i] == DD_MD_NO_HOLDER)
			continue;
		/* Stored lately, its copy may still be in memory: no read. */
		switch (dd_data_stored_compare(&dc->data_pool, at[i],
					       dc->reuse_seq, blk[i].data)) {
		case DD_KEPT_SAME:
			v->same[i] = at[i] + 1;
			in_memory = true;
			continue;
		case DD_KEPT_DIFFERENT:
			v->same[i] = dd_kept_other_holder(dc, &blk[i], at[i]);
			in_memory |= v->same[i];
			continue;
		case DD_KEPT_NONE:
			break;
		}
		/* In the order of the holders, so that neighbours share a read. */
		for (j = m++; j && at[order[j - 1]] > at[i]; j--)
			order[j] = order[j - 1];
		order[j] = i;
	}
	for (k = 0; k < m; k++) {
		i = order[k];
		/* Equal blocks: one read for all. */
		if (n && at[i] == v->pba[n - 1]) {
			v->read[i] = n - 1;
			continue;
		}
		v->pba[n] = at[i];
		/* Short of memory, the block's own steps store a copy. */
		v->page[n] = alloc_page(GFP_NOIO | __GFP_NORETRY | __GFP_NOWARN);
		if (v->page[n])
			v->read[i] = n++;
	}
	v->seq = dc->reuse_seq;
	if (!n && in_memory)
		return v;
	if (!n)
		goto none;
	up_read(&dc->lock);
	dd_write_owner(blk->w, &owner);
	atomic64_add(dd_data_read(dc->data_dev->bdev, &dc->bs, v->pba, v->page,
				  v->error, n, &v->reads, &owner),
		     &dc->verify_reads);
	for (i = 0; i < nr; i++) {
		k = v->read[i];
		if (k != U8_MAX && !v->error[k] &&
		    dd_data_equal(v->page[k], blk[i].data))
			v->same[i] = v->pba[k] + 1;
	}
	for (k = 0; k < n; k++)
		__free_page(v->page[k]);
	down_read(&dc->lock);
	if (dc->reuse_seq == v->seq)
		return v;
none:
	kfree(v);
	return NULL;
}

/*
 * The blocks whose content the index already knows, shared in groups of
 * up to DD_MAP_BATCH per trip through the index lock and the metadata
 * lock: with duplicate-heavy data (clones, VM images) that is most
 * blocks. Each share checks liveness and the fingerprint record itself,
 * as dd_share does. Content the index does not know is decided in the
 * same hold as its lookup (DD_STORE or DD_PARKED): looking it up again
 * in dd_try_dedup would find nothing more, and unique data would pay for
 * both lookups. Under verify, only blocks whose bytes were compared are
 * shared here (dd_verify_write). Anything else (zero blocks, a candidate
 * that died, one that verify did not confirm) is left DD_UNDECIDED for
 * dd_decide_block.
 */
static noinline_for_stack void
dd_share_known(struct dedup_c *dc, struct dd_write_block *blk, unsigned int nr,
	       u8 *decision)
{
	struct dd_verified *v = NULL;
	struct dd_md_dup d[DD_MAP_BATCH];
	u8 which[DD_MAP_BATCH];
	struct dd_md_freed freed;
	unsigned int i = 0, n, k, done;
	u64 cand;

	lockdep_assert_held_read(&dc->lock);
	memset(decision, DD_UNDECIDED, nr);
	if (READ_ONCE(dc->mode) != DD_MODE_RW)
		return;
	if (dc->verify)
		v = dd_verify_write(dc, blk, nr);
	while (i < nr) {
		if (i)
			dd_let_commit_in(dc);
		n = 0;
		spin_lock(&dc->index_lock);
		for (; i < nr && n < DD_MAP_BATCH; i++) {
			if (blk[i].flags & DD_BLOCK_ZERO)
				continue;
			/*
			 * Under verify, a block is shared only with the holder
			 * whose bytes it was compared with since the last
			 * commit that let freed blocks be reused (the holder
			 * may be one); the share checks that it still lives.
			 */
			d[n].only = 0;
			if (v && i < DD_BIO_BLOCKS && dc->reuse_seq == v->seq)
				d[n].only = v->same[i];
			if (d[n].only) {
				cand = dd_index_leaf_of(d[n].only - 1);
			} else if (!dd_index_candidates(dc, blk[i].fp, NULL, 0,
							&cand, 1)) {
				/* New content: one lookup decides it. */
				decision[i] = dd_lead_or_park(dc, &blk[i]);
				continue;
			} else if (dc->verify) {
				continue;	/* not compared: its own steps */
			}
			d[n].lba = blk[i].lba;
			d[n].leaf = cand;
			d[n].fp = blk[i].fp;
			which[n++] = i;
		}
		spin_unlock(&dc->index_lock);
		for (k = 0; k < n; k += done) {
			if (READ_ONCE(dc->mode) != DD_MODE_RW)
				goto out;
			dd_md_map_duplicates(dc->md, d + k, n - k, &done, &freed);
			dd_shared_known(dc, blk, decision, d + k, which + k, done,
					&freed);
		}
	}
out:
	kfree(v);
}

/*
 * A write acknowledged before it is decided (early_ack) must not fail for
 * want of space afterwards, whatever its decision: a data block is
 * promised to each of its blocks that is not zero, before the
 * acknowledgment. A block that stores its data takes its physical block
 * against its promise (dd_give_blocks); one that shares, or fails, gives
 * its promise back once decided; a parked one keeps it until then.
 * False, and nothing promised, when the device has too few free blocks:
 * the write is then acknowledged once decided, if at all.
 */
bool dd_decide_promise(struct dedup_c *dc, struct dd_write_block *blk,
		       unsigned int nr)
{
	unsigned int i, n = 0;

	if (READ_ONCE(dc->mode) != DD_MODE_RW)
		return false;
	for (i = 0; i < nr; i++)
		n += !(blk[i].flags & DD_BLOCK_ZERO);
	if (!dd_md_promise_data(dc->md, n))
		return false;
	for (i = 0; i < nr; i++)
		if (!(blk[i].flags & DD_BLOCK_ZERO))
			blk[i].flags |= DD_BLOCK_PROMISED;
	return true;
}

/* Blocks decided without a new physical block give their promise back. */
static void dd_unpromise_done(struct dedup_c *dc, struct dd_write_block *blk,
			      unsigned int nr, const u8 *decision)
{
	unsigned int i, n = 0;

	for (i = 0; i < nr; i++) {
		if (decision[i] != DD_DONE ||
		    !(blk[i].flags & DD_BLOCK_PROMISED))
			continue;
		blk[i].flags &= ~DD_BLOCK_PROMISED;
		n++;
	}
	dd_md_promise_drop(dc->md, n);
}

/*
 * Decide the @nr hashed blocks @blk[], the blocks of one write or one
 * block decided again, holding the transaction lock shared (let go
 * between steps for a commit, and for verify's reads). What became
 * of each is in @decision[]: a parked block belongs to whoever requeues
 * it from then on, so the caller must not look at it again.
 */
void dd_decide_write(struct dedup_c *dc, struct dd_write_block *blk,
		     unsigned int nr, u8 *decision)
{
	struct dd_write *w = blk->w;
	unsigned int i, nr_store = 0;

	down_read(&dc->lock);
	dd_share_known(dc, blk, nr, decision);
	for (i = 0; i < nr; i++) {
		/*
		 * Each block's decision stands on its own: a commit may come
		 * between two blocks. Blocks waiting for their data's place
		 * stay in the in-flight table across it, unmapped.
		 */
		if (decision[i] == DD_UNDECIDED) {
			if (i)
				dd_let_commit_in(dc);
			decision[i] = dd_decide_block(dc, &blk[i]);
		}
		nr_store += decision[i] == DD_STORE;
	}
	if (nr_store)
		dd_give_blocks(dc, blk, nr, decision, nr_store);
	dd_unpromise_done(dc, blk, nr, decision);
	/* Not parked blocks': they are no longer ours to look at. */
	dd_raise(&w->append, dd_change_append(dc));
	up_read(&dc->lock);
}

/*
 * Map @blk[0..@nr), blocks of stored runs, as many per trip through the
 * metadata lock as it takes (up to DD_MAP_BATCH, or up to one that frees
 * a block); b->error says what became of each.
 */
static void dd_map_stored(struct dedup_c *dc, struct dd_write_block **blk,
			  unsigned int nr)
{
	struct dd_md_new nb[DD_MAP_BATCH];
	struct dd_md_freed freed;
	struct dd_write_block *b;
	unsigned int n, done, i;
	int r, rb;

	lockdep_assert_held_read(&dc->lock);
	while (nr) {
		n = min_t(unsigned int, nr, DD_MAP_BATCH);
		for (i = 0; i < n; i++) {
			nb[i].lba = blk[i]->lba;
			nb[i].pba = blk[i]->pba;
			nb[i].fp = blk[i]->fp;
		}
		r = dd_md_map_new_run(dc->md, nb, n, &done, &freed);
		for (i = 0; i < done; i++) {
			b = blk[i];
			rb = dd_changed(dc, i + 1 < done ? 0 : r, &freed);
			if (rb) {
				dd_change_failed(dc, "mapping a new block", rb);
				spin_lock(&dc->index_lock);
				dd_index_remove(&dc->index, b->fp, b->pba);
				spin_unlock(&dc->index_lock);
			}
			b->error = rb;
		}
		if (r >= 0)
			dd_check_writeback(dc);
		blk += done;
		nr -= done;
	}
}

/*
 * The data of @nr runs of DD_STORE blocks (each chained by run_next) was
 * written, or failed with the error in the run's first block: map each
 * block, and only now let others share it. Runs done go to the front of
 * @runs, in order, and their number is returned; b->error says what
 * became of each block. The others wait for the commit under way, which
 * queues their work again (dd_data_covered).
 *
 * All runs are decided in one hold of the transaction lock and of the
 * index lock per step, and their blocks are mapped together: the runs
 * that completed meanwhile share the trips through the metadata lock.
 *
 * A block enters the index before it is mapped, while it still leads its
 * content in the in-flight table: whoever finds it in that window finds
 * it not live yet, looks further, and waits for it (or, if it has left
 * the table by then, looks again: dd_try_dedup). Entered after the
 * mapping instead, a write that freed the block in between would find
 * nothing to forget, and the entry would outlive the block.
 */
unsigned int dd_decide_stored_runs(struct dedup_c *dc,
				   struct dd_write_block **runs,
				   unsigned int nr)
{
	struct dd_write_block *todo[DD_STORED_BLOCKS], *run, *b;
	unsigned int i, len, kept = 0, nr_todo = 0;
	u64 append;
	int error;

	if (WARN_ON_ONCE(nr > DD_STORED_RUNS))
		nr = DD_STORED_RUNS;
	down_read(&dc->lock);
	for (i = 0; i < nr; i++) {
		run = runs[i];
		error = run->error;
		if (!error && READ_ONCE(dc->mode) != DD_MODE_RW)
			error = -EIO;
		if (!error && !dd_data_covered(dc, run))
			continue;
		runs[kept++] = run;
		len = dd_run_len(run);
		/* The caller keeps to DD_STORED_BLOCKS; fail a run beyond. */
		if (!error && WARN_ON_ONCE(nr_todo + len > DD_STORED_BLOCKS))
			error = -EIO;
		for (b = run; b; b = b->run_next) {
			if (error) {
				dd_md_free_data_now(dc->md, b->pba);
				b->error = error;
			} else {
				todo[nr_todo++] = b;
			}
		}
	}
	spin_lock(&dc->index_lock);
	for (i = 0; i < nr_todo; i++)
		dd_index_add(dc, todo[i]->fp, todo[i]->pba);
	spin_unlock(&dc->index_lock);
	dd_map_stored(dc, todo, nr_todo);
	spin_lock(&dc->index_lock);
	for (i = 0; i < kept; i++)
		for (b = runs[i]; b; b = b->run_next)
			dd_inflight_leave(dc, b);
	spin_unlock(&dc->index_lock);
	for (i = 0; i < nr_todo; i++)
		if (!todo[i]->error)
			dd_inflight_twins(dc, todo[i]);
	/*
	 * Under verify, copies of a block just stored tend to come soon
	 * after it: its page is kept to compare them with. What the block
	 * holds stays as it is at least until a commit lets it be reused
	 * (reuse_seq moves), which the lock holds off until the page is kept.
	 * Kept before its waiters wake: one that differs from it is then
	 * told so without a read, unless a block stored later took the slot.
	 */
	if (dc->verify) {
		for (i = 0; i < nr_todo; i++) {
			b = todo[i];
			if (b->error)
				continue;
			dd_data_keep_stored(&dc->data_pool, b->pba,
					    dc->reuse_seq, b->data);
			b->data = NULL;
		}
	}
	for (i = 0; i < kept; i++)
		for (b = runs[i]; b; b = b->run_next)
			dd_inflight_wake(dc, b);
	append = dd_change_append(dc);
	for (i = 0; i < nr_todo; i++)
		dd_raise(&todo[i]->w->append, append);
	up_read(&dc->lock);
	return kept;
}

/* One run, as dd_decide_stored_runs(); false: it waits for the commit. */
bool dd_decide_stored(struct dedup_c *dc, struct dd_write_block *run, int error)
{
	run->error = error;
	return dd_decide_stored_runs(dc, &run, 1) == 1;
}

/*
 * Discard or write zeroes: unmap [begin, end), a chunk per hold of the
 * locks so that other I/O and commits run between chunks. A commit may
 * land between two chunks; the discard is not complete until the last,
 * and its changes go with *@append (dd_change_append) or an earlier one.
 */
int dd_decide_unmap(struct dedup_c *dc, u64 begin, u64 end, u64 *append)
{
	struct dd_md_freed freed[DD_FREED_BATCH];
	unsigned int nr_freed;
	u64 unmapped = 0;
	int r = 0;

	while (!r && begin < end) {
		down_read(&dc->lock);
		if (READ_ONCE(dc->mode) != DD_MODE_RW) {
			up_read(&dc->lock);
			return -EIO;
		}
		r = dd_md_unmap_range(dc->md, begin,
				      min(end, begin + DD_UNMAP_CHUNK), freed,
				      ARRAY_SIZE(freed), &nr_freed, &begin,
				      &unmapped);
		/* Blocks freed before an error left the index too. */
		dd_index_forget(dc, freed, nr_freed);
		if (r)
			dd_metadata_error(dc, "discard", r);
		else
			dd_check_writeback(dc);
		*append = dd_change_append(dc);
		up_read(&dc->lock);
		cond_resched();
	}
	return r;
}
