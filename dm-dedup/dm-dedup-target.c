// SPDX-License-Identifier: GPL-2.0-only
/*
 * dm-dedup: device-mapper target that deduplicates 4 KiB blocks inline.
 *
 * This file is the I/O path: bios, locking, workqueues and commits. It
 * talks to the persistent state only through dedup-metadata.h, and to the
 * RAM fingerprint index through dedup-index.h.
 *
 * Locking: dc->lock (an rwsem) covers the metadata, the index and the
 * table of in-flight unique writes. Read lookups share it; every change
 * and every commit hold it exclusively. Hashing and data I/O run without
 * it, on an unbound workqueue, so they spread over all CPUs.
 */
#define DM_MSG_PREFIX "dedup"

#include <linux/bio.h>
#include <linux/blkdev.h>
#include <linux/device-mapper.h>
#include <linux/hashtable.h>
#include <linux/highmem.h>
#include <linux/module.h>
#include <linux/rwsem.h>
#include <linux/slab.h>
#include <linux/unaligned.h>
#include <linux/workqueue.h>

#include "dedup-data.h"
#include "dedup-fingerprint.h"
#include "dedup-index.h"
#include "dedup-metadata.h"

#define DD_DEFAULT_HASH			"sha256"
#define DD_DEFAULT_COMMIT_INTERVAL	1	/* seconds */
#define DD_MAX_COMMIT_INTERVAL		3600
/* Bounds how long one discard holds the metadata lock. */
#define DD_MAX_DISCARD_SECTORS		(64ULL << (20 - SECTOR_SHIFT))
#define DD_INFLIGHT_BITS		8
/* Verification retries when a commit overtook the compare. */
#define DD_VERIFY_ATTEMPTS		4
/*
 * Candidates compared byte for byte before storing a copy: with a short
 * hash, somebody may have planted a colliding block in front of the real
 * duplicate.
 */
#define DD_VERIFY_CANDIDATES		8
/*
 * Copies of data blocks kept in reserve for writes (1 MiB). A writer that
 * finds none free waits in map until a write completes.
 */
#define DD_DATA_RESERVE			256

enum dd_mode {
	DD_MODE_RW,
	DD_MODE_RO,		/* read_only asked for, or a metadata I/O error */
	DD_MODE_NEEDS_CHECK,	/* metadata found damaged: run dedup check */
};

static const char * const dd_mode_names[] = {
	[DD_MODE_RW] = "rw",
	[DD_MODE_RO] = "ro",
	[DD_MODE_NEEDS_CHECK] = "needs_check",
};

struct dedup_c {
	struct dm_target *ti;
	struct list_head instance;	/* on dd_instances */
	struct dm_dev *meta_dev;
	struct dm_dev *data_dev;
	struct dd_metadata *md;
	struct dd_index index;
	struct dd_hasher hasher;
	struct dd_data_pool data_pool;

	struct rw_semaphore lock;
	DECLARE_HASHTABLE(inflight, DD_INFLIGHT_BITS);	/* unique writes */

	struct workqueue_struct *wq;
	struct workqueue_struct *commit_wq;
	struct work_struct commit_work;
	struct delayed_work periodic_commit;
	struct work_struct abort_work;	/* for errors found under a shared lock */

	spinlock_t commit_lock;		/* protects the two lists below */
	struct bio_list commit_waiters;	/* flushes and FUA writes */
	struct list_head nospc_waiters;	/* writes waiting for freed blocks */

	/* Reads that may still touch a block freed in this transaction. */
	atomic_t reads_inflight;
	wait_queue_head_t reads_wait;

	struct bio_set bs;

	/* table */
	u64 logical_blocks;
	u64 data_blocks;
	unsigned int commit_interval;
	u64 low_water_mark;
	bool verify;
	bool discard_passdown;
	bool read_only;

	int mode;
	bool low_water_raised;
	u64 commit_seq;			/* successful commits, under lock */

	/* not persistent: describe this activation */
	atomic64_t verify_mismatches;
	atomic64_t index_full;
	atomic64_t nospc_errors;
	atomic64_t data_write_errors;
	atomic64_t deferred_reads;
	atomic64_t discard_passdown_blocks;
};

/*
 * Every constructed dedup target, so that a table reload of the same
 * device can defer opening the metadata until the old table is suspended,
 * and another device cannot open metadata or data that is in use.
 */
static LIST_HEAD(dd_instances);
static DEFINE_MUTEX(dd_instances_lock);

enum dd_io_flags {
	DD_IO_HASHED = 1 << 0,
	DD_IO_ZERO = 1 << 1,
	DD_IO_READ_TRACKED = 1 << 2,
};

/* Per-bio state, in the space dm reserves for the target. */
struct dd_io {
	struct dedup_c *dc;
	struct work_struct work;
	u64 lba;
	u64 pba;
	struct page *data;		/* a write's copy of its block */
	u8 fp[DD_FP_SIZE];
	unsigned int flags;
	blk_status_t status;
	struct hlist_node inflight_node;
	struct list_head waiters;	/* same content, waiting for us */
	struct list_head wait_entry;
};

static struct bio *dd_bio(struct dd_io *io)
{
	return dm_bio_from_per_bio_data(io, sizeof(*io));
}

static const char *dd_name(struct dedup_c *dc)
{
	return dm_table_device_name(dc->ti->table);
}

/* ------------------------------------------------------------------ */
/* modes and errors */

static void dd_degrade(struct dedup_c *dc, int mode, const char *what, int r)
{
	if (READ_ONCE(dc->mode) >= mode)
		return;
	WRITE_ONCE(dc->mode, mode);
	DMERR("%s: %s failed (error %d); switching to %s mode%s", dd_name(dc),
	      what, r, dd_mode_names[mode],
	      mode == DD_MODE_NEEDS_CHECK ? ": run dedup check" : "");
}

static int dd_error_mode(int r)
{
	return r == -EILSEQ ? DD_MODE_NEEDS_CHECK : DD_MODE_RO;
}

/*
 * A metadata change failed, maybe half done: nothing more may reach the
 * disk, and reads fall back to the last commit. Needs dc->lock exclusive.
 */
static void dd_metadata_error(struct dedup_c *dc, const char *what, int r)
{
	dd_degrade(dc, dd_error_mode(r), what, r);
	dd_md_abort(dc->md);
}

/*
 * dm-bufio writes metadata in the background when dirty blocks pile up and
 * keeps a failed write's error until it is asked; meanwhile the block is
 * gone from the cache and the location holds older content. Ask after
 * every change, so the device stops within one write, not at the next
 * commit up to commit_interval later.
 */
static void dd_check_writeback(struct dedup_c *dc)
{
	int r;

	lockdep_assert_held_write(&dc->lock);
	r = dd_md_writeback_error(dc->md);
	if (r)
		dd_metadata_error(dc, "background metadata write", r);
}

static blk_status_t dd_errno_to_status(int r)
{
	switch (r) {
	case 0:
		return BLK_STS_OK;
	case -ENOSPC:
		return BLK_STS_NOSPC;
	default:
		return BLK_STS_IOERR;
	}
}

static void dd_endio(struct bio *bio, blk_status_t status)
{
	bio->bi_status = status;
	bio_endio(bio);
}

/* ------------------------------------------------------------------ */
/* commits */

static void dd_defer_to_commit(struct dedup_c *dc, struct bio *bio)
{
	spin_lock_irq(&dc->commit_lock);
	bio_list_add(&dc->commit_waiters, bio);
	spin_unlock_irq(&dc->commit_lock);
	queue_work(dc->commit_wq, &dc->commit_work);
}

static void dd_discard_passdown(void *ctx, u64 begin, u64 end)
{
	struct dedup_c *dc = ctx;
	int r;

	r = blkdev_issue_discard(dc->data_dev->bdev,
				 begin * DD_SECTORS_PER_BLOCK,
				 (end - begin) * DD_SECTORS_PER_BLOCK, GFP_NOIO);
	if (r && r != -EOPNOTSUPP)
		DMWARN_LIMIT("%s: discard passdown of physical blocks %llu-%llu failed: %d",
			     dd_name(dc), begin, end - 1, r);
	else if (!r)
		atomic64_add(end - begin, &dc->discard_passdown_blocks);
}

static void dd_blocks_reusable(void *ctx, u64 begin, u64 end)
{
	struct dedup_c *dc = ctx;

	if (dc->discard_passdown)
		dd_discard_passdown(dc, begin, end);
}

static int dd_commit(struct dedup_c *dc)
{
	int r = 0;

	down_write(&dc->lock);
	if (dc->read_only || !dc->md)
		goto out;	/* nothing was ever changed */
	if (READ_ONCE(dc->mode) != DD_MODE_RW) {
		r = -EIO;
		goto out;
	}
	if (!dd_md_dirty(dc->md))
		goto out;
	/* What the new state points at must be stable before the state. */
	r = blkdev_issue_flush(dc->data_dev->bdev);
	if (r) {
		/* The new state may point at data that is not stable. */
		dd_metadata_error(dc, "flushing the data device", r);
		goto out;
	}
	/*
	 * Blocks freed in this transaction become reusable below; a read
	 * that looked one up before it was freed must not see new content.
	 * New lookups are excluded by the lock.
	 */
	if (dd_md_pending_data_frees(dc->md))
		wait_event(dc->reads_wait, !atomic_read(&dc->reads_inflight));
	r = dd_md_commit(dc->md, dd_blocks_reusable, dc);
	if (r) {
		dd_metadata_error(dc, "metadata commit", r);
		goto out;
	}
	dc->commit_seq++;
	if (dc->low_water_raised &&
	    dd_md_free_data_blocks(dc->md) > dc->low_water_mark)
		dc->low_water_raised = false;
out:
	up_write(&dc->lock);
	return r;
}

static void dd_write_work(struct work_struct *w);

static void dd_commit_work(struct work_struct *w)
{
	struct dedup_c *dc = container_of(w, struct dedup_c, commit_work);
	struct dd_io *io, *tmp;
	struct bio_list bios;
	struct bio *bio;
	LIST_HEAD(retry);
	int r;

	spin_lock_irq(&dc->commit_lock);
	bios = dc->commit_waiters;
	bio_list_init(&dc->commit_waiters);
	list_splice_init(&dc->nospc_waiters, &retry);
	spin_unlock_irq(&dc->commit_lock);

	r = dd_commit(dc);

	while ((bio = bio_list_pop(&bios)))
		dd_endio(bio, r ? BLK_STS_IOERR : BLK_STS_OK);
	list_for_each_entry_safe(io, tmp, &retry, wait_entry) {
		list_del_init(&io->wait_entry);
		INIT_WORK(&io->work, dd_write_work);
		queue_work(dc->wq, &io->work);
	}
}

/*
 * A read found the metadata damaged, or a block of the running transaction
 * that lost its write, while holding the lock shared: roll
 * back to the last commit as every other metadata error does, so reads
 * show exactly that commit and nothing of the dead transaction stays dirty.
 */
static void dd_abort_work(struct work_struct *w)
{
	struct dedup_c *dc = container_of(w, struct dedup_c, abort_work);

	down_write(&dc->lock);
	dd_md_abort(dc->md);
	up_write(&dc->lock);
}

static void dd_periodic_commit(struct work_struct *w)
{
	struct dedup_c *dc = container_of(to_delayed_work(w), struct dedup_c,
					  periodic_commit);

	queue_work(dc->commit_wq, &dc->commit_work);
	queue_delayed_work(dc->commit_wq, &dc->periodic_commit,
			   dc->commit_interval * HZ);
}

/* ------------------------------------------------------------------ */
/* index glue, called by the metadata with dc->lock held */

static int dd_index_visit(void *ctx, u64 pba, const u8 *fp)
{
	struct dedup_c *dc = ctx;
	int r = dd_index_insert(&dc->index, fp, pba);

	if (r == -ENOSPC) {
		atomic64_inc(&dc->index_full);
		return 0;	/* stays readable, just not a dedup target */
	}
	return r;
}

static void dd_index_forget(struct dedup_c *dc, const struct dd_md_freed *f)
{
	dd_index_remove(&dc->index, f->fp, f->pba);
}

static bool dd_pba_in(u64 pba, const u64 *set, unsigned int nr)
{
	while (nr--)
		if (set[nr] == pba)
			return true;
	return false;
}

/*
 * A live physical block whose full fingerprint equals @fp, other than the
 * @nr_skip in @skip, or -ENODATA. The index only narrows the search; the
 * persistent record decides.
 */
static int dd_find_duplicate(struct dedup_c *dc, const u8 *fp,
			     const u64 *skip, unsigned int nr_skip, u64 *pba)
{
	u8 stored[DD_FP_SIZE];
	struct dd_index_iter it;
	u64 candidate;
	int r;

	dd_index_iter_init(&dc->index, fp, &it);
	while (dd_index_iter_next(&dc->index, &it, &candidate)) {
		if (dd_pba_in(candidate, skip, nr_skip))
			continue;
		r = dd_md_get_fingerprint(dc->md, candidate, stored);
		if (r)
			return r;
		if (!memcmp(stored, fp, DD_FP_SIZE)) {
			*pba = candidate;
			return 0;
		}
	}
	return -ENODATA;
}

static u32 dd_inflight_key(const u8 *fp)
{
	return get_unaligned_le32(fp);
}

static struct dd_io *dd_inflight_find(struct dedup_c *dc, const u8 *fp)
{
	struct dd_io *io;

	hash_for_each_possible(dc->inflight, io, inflight_node,
			       dd_inflight_key(fp))
		if (!memcmp(io->fp, fp, DD_FP_SIZE))
			return io;
	return NULL;
}

/* ------------------------------------------------------------------ */
/* reads */

/* Called with dc->lock held (shared). */
static int dd_read_lookup(struct dedup_c *dc, struct dd_io *io, bool nowait)
{
	struct bio *bio = dd_bio(io);
	u64 pba;
	int r;

	r = dd_md_lookup(dc->md, io->lba, &pba, nowait);
	if (r == -EWOULDBLOCK)
		return r;
	if (r == -ENODATA) {
		zero_fill_bio(bio);
		bio_endio(bio);
		return DM_MAPIO_SUBMITTED;
	}
	if (r) {
		/* Damage, or a metadata write lost in the background. */
		if (r == -EILSEQ || r == -ESTALE) {
			dd_degrade(dc, dd_error_mode(r), "map lookup", r);
			queue_work(dc->commit_wq, &dc->abort_work);
		}
		dd_endio(bio, BLK_STS_IOERR);
		return DM_MAPIO_SUBMITTED;
	}
	io->flags |= DD_IO_READ_TRACKED;
	atomic_inc(&dc->reads_inflight);
	bio_set_dev(bio, dc->data_dev->bdev);
	bio->bi_iter.bi_sector = pba * DD_SECTORS_PER_BLOCK;
	return DM_MAPIO_REMAPPED;
}

static void dd_read_work(struct work_struct *w)
{
	struct dd_io *io = container_of(w, struct dd_io, work);
	struct dedup_c *dc = io->dc;
	int r;

	down_read(&dc->lock);
	r = dd_read_lookup(dc, io, false);
	up_read(&dc->lock);
	if (r == DM_MAPIO_REMAPPED)
		dm_submit_bio_remap(dd_bio(io), NULL);
}

static int dd_map_read(struct dedup_c *dc, struct dd_io *io)
{
	int r = -EWOULDBLOCK;

	/* The common case needs no worker: the map is in the cache. */
	if (down_read_trylock(&dc->lock)) {
		r = dd_read_lookup(dc, io, true);
		up_read(&dc->lock);
	}
	if (r != -EWOULDBLOCK)
		return r;
	atomic64_inc(&dc->deferred_reads);
	INIT_WORK(&io->work, dd_read_work);
	queue_work(dc->wq, &io->work);
	return DM_MAPIO_SUBMITTED;
}

/* ------------------------------------------------------------------ */
/* writes */

static void dd_finish_write(struct dedup_c *dc, struct dd_io *io, int r)
{
	struct bio *bio = dd_bio(io);

	if (io->data) {
		dd_data_put(&dc->data_pool, io->data);
		io->data = NULL;
	}
	if (r == -EROFS)
		r = -EIO;
	if (!r && (bio->bi_opf & REQ_FUA)) {
		/* Durable when it completes: the commit completes it. */
		dd_defer_to_commit(dc, bio);
		return;
	}
	dd_endio(bio, dd_errno_to_status(r));
}

static void dd_low_water_check(struct dedup_c *dc, u64 free)
{
	if (!dc->low_water_mark || free > dc->low_water_mark ||
	    dc->low_water_raised)
		return;
	dc->low_water_raised = true;
	DMWARN("%s: free data blocks (%llu) reached the low water mark (%llu)",
	       dd_name(dc), free, dc->low_water_mark);
	dm_table_event(dc->ti->table);
}

/* Does physical block @pba hold exactly the write's data? */
static int dd_same_content(struct dedup_c *dc, struct dd_io *io, u64 pba)
{
	struct bio_vec rvec;
	struct bio rbio;
	struct page *page;
	int r;

	page = alloc_page(GFP_NOIO);
	if (!page)
		return -ENOMEM;
	bio_init(&rbio, dc->data_dev->bdev, &rvec, 1, REQ_OP_READ);
	rbio.bi_iter.bi_sector = pba * DD_SECTORS_PER_BLOCK;
	__bio_add_page(&rbio, page, DD_BLOCK_SIZE, 0);
	r = submit_bio_wait(&rbio);
	bio_uninit(&rbio);
	if (!r)
		r = dd_data_equal(page, io->data);
	__free_page(page);
	return r;
}

static void dd_unique_endio(struct bio *clone)
{
	struct dd_io *io = clone->bi_private;

	io->status = clone->bi_status;
	bio_put(clone);
	queue_work(io->dc->wq, &io->work);
}

static void dd_unique_done_work(struct work_struct *w)
{
	struct dd_io *io = container_of(w, struct dd_io, work);
	struct dedup_c *dc = io->dc;
	struct dd_io *waiter, *tmp;
	struct dd_md_freed freed;
	int r = 0, ir;

	down_write(&dc->lock);
	hash_del(&io->inflight_node);
	if (io->status) {
		atomic64_inc(&dc->data_write_errors);
		dd_md_free_data_now(dc->md, io->pba);
		r = blk_status_to_errno(io->status);
	} else if (READ_ONCE(dc->mode) != DD_MODE_RW) {
		dd_md_free_data_now(dc->md, io->pba);
		r = -EIO;
	} else {
		r = dd_md_map_new(dc->md, io->lba, io->pba, io->fp, &freed);
		if (r > 0) {
			dd_index_forget(dc, &freed);
			r = 0;
		}
		if (r) {
			dd_metadata_error(dc, "mapping a new block", r);
		} else {
			/* Only now is the content on disk to share. */
			ir = dd_index_insert(&dc->index, io->fp, io->pba);
			if (ir)
				atomic64_inc(&dc->index_full);
			dd_check_writeback(dc);
		}
	}
	/* Writers of the same content decide again, now against the index. */
	list_for_each_entry_safe(waiter, tmp, &io->waiters, wait_entry) {
		list_del_init(&waiter->wait_entry);
		INIT_WORK(&waiter->work, dd_write_work);
		queue_work(dc->wq, &waiter->work);
	}
	up_write(&dc->lock);
	dd_finish_write(dc, io, r);
}

/* Writes our copy, never the submitter's pages: see dedup-data.h. */
static void dd_submit_unique(struct dedup_c *dc, struct dd_io *io)
{
	struct bio *bio = dd_bio(io), *clone;

	/* Durability comes from the commit, which flushes the data device. */
	clone = bio_alloc_bioset(dc->data_dev->bdev, 1,
				 bio->bi_opf & ~(REQ_FUA | REQ_PREFLUSH),
				 GFP_NOIO, &dc->bs);
	bio_clone_blkg_association(clone, bio);
	clone->bi_ioprio = bio->bi_ioprio;
	clone->bi_iter.bi_sector = io->pba * DD_SECTORS_PER_BLOCK;
	__bio_add_page(clone, io->data, DD_BLOCK_SIZE, 0);
	clone->bi_end_io = dd_unique_endio;
	clone->bi_private = io;
	INIT_WORK(&io->work, dd_unique_done_work);
	submit_bio_noacct(clone);
}

/* Try to share an existing block. 1: shared, 0: store it, < 0: error. */
static int dd_try_dedup(struct dedup_c *dc, struct dd_io *io)
{
	unsigned int attempts = 0, nr_differ = 0;
	u64 differ[DD_VERIFY_CANDIDATES];
	struct dd_md_freed freed;
	u64 pba, seq;
	u32 refs;
	int r;

again:
	r = dd_find_duplicate(dc, io->fp, differ, nr_differ, &pba);
	if (r == -ENODATA)
		return 0;
	if (r)
		return r;
	if (dc->verify) {
		/*
		 * Compare without the lock. A live block's content never
		 * changes and a freed block is reused only after a commit: if
		 * no commit ran meanwhile and the block is still live, what was
		 * read is what it holds. Holding a reference across the window
		 * instead could let a commit store a refcount no map entry has.
		 */
		seq = dc->commit_seq;
		up_write(&dc->lock);
		r = dd_same_content(dc, io, pba);
		down_write(&dc->lock);
		if (READ_ONCE(dc->mode) != DD_MODE_RW)
			return -EIO;
		if (r < 0)
			return 0;	/* unreadable: store a copy of its own */
		if (!r) {
			/*
			 * Different content under the same fingerprint: look
			 * further, afresh, since the index may have changed
			 * while the lock was dropped.
			 */
			atomic64_inc(&dc->verify_mismatches);
			if (nr_differ == ARRAY_SIZE(differ))
				return 0;
			differ[nr_differ++] = pba;
			goto again;
		}
		r = dd_md_get_refcount(dc->md, pba, &refs);
		if (r)
			return r;
		if (!refs || dc->commit_seq != seq) {
			if (++attempts < DD_VERIFY_ATTEMPTS)
				goto again;
			return 0;
		}
	}
	r = dd_md_map_duplicate(dc->md, io->lba, pba, &freed);
	if (r == -EOVERFLOW)
		return 0;	/* refcount saturated: store another copy */
	if (r == -ENOENT) {
		DMERR_LIMIT("physical block %llu: reference taken on a free block",
			    pba);
		return -EILSEQ;
	}
	if (r < 0)
		return r;
	if (r)
		dd_index_forget(dc, &freed);
	return 1;
}

static void dd_write_decide(struct dedup_c *dc, struct dd_io *io)
{
	struct dd_md_freed freed;
	struct dd_io *leader;
	u64 free_left;
	int r;

	down_write(&dc->lock);
	if (READ_ONCE(dc->mode) != DD_MODE_RW) {
		r = -EIO;
		goto out;
	}
	if (io->flags & DD_IO_ZERO) {
		r = dd_md_map_zero(dc->md, io->lba, &freed);
		if (r > 0) {
			dd_index_forget(dc, &freed);
			r = 0;
		}
		goto metadata_done;
	}
	r = dd_try_dedup(dc, io);
	if (r) {
		r = r > 0 ? 0 : r;
		goto metadata_done;
	}
	/*
	 * Same content already on its way to disk: wait for it rather than
	 * store it twice, and never share a block before its data is written.
	 */
	leader = dd_inflight_find(dc, io->fp);
	if (leader) {
		list_add_tail(&io->wait_entry, &leader->waiters);
		up_write(&dc->lock);
		return;
	}
	r = dd_md_alloc_data(dc->md, &io->pba, &free_left);
	if (r == -EAGAIN) {
		/* Blocks freed by this transaction come back at its commit. */
		spin_lock_irq(&dc->commit_lock);
		list_add_tail(&io->wait_entry, &dc->nospc_waiters);
		spin_unlock_irq(&dc->commit_lock);
		up_write(&dc->lock);
		queue_work(dc->commit_wq, &dc->commit_work);
		return;
	}
	if (r) {
		if (r == -ENOSPC)
			atomic64_inc(&dc->nospc_errors);
		goto out;
	}
	INIT_LIST_HEAD(&io->waiters);
	hash_add(dc->inflight, &io->inflight_node, dd_inflight_key(io->fp));
	dd_low_water_check(dc, free_left);
	up_write(&dc->lock);
	dd_submit_unique(dc, io);
	return;

metadata_done:
	/* A failed change may be half done: nothing more may be committed. */
	if (r && r != -EROFS)
		dd_metadata_error(dc, "write", r);
	else if (!r)
		dd_check_writeback(dc);
out:
	up_write(&dc->lock);
	dd_finish_write(dc, io, r);
}

static void dd_write_work(struct work_struct *w)
{
	struct dd_io *io = container_of(w, struct dd_io, work);
	struct dedup_c *dc = io->dc;
	void *p;
	int r;

	if (!(io->flags & DD_IO_HASHED)) {
		if (dd_data_is_zero(io->data)) {
			io->flags |= DD_IO_ZERO;
		} else {
			p = kmap_local_page(io->data);
			r = dd_fingerprint_block(&dc->hasher, p, io->fp);
			kunmap_local(p);
			if (r) {
				DMERR_LIMIT("%s: hashing failed: %d", dd_name(dc), r);
				dd_finish_write(dc, io, r);
				return;
			}
		}
		io->flags |= DD_IO_HASHED;
	}
	dd_write_decide(dc, io);
}

/* ------------------------------------------------------------------ */
/* discard and write zeroes */

static void dd_discard_work(struct work_struct *w)
{
	struct dd_io *io = container_of(w, struct dd_io, work);
	struct dedup_c *dc = io->dc;
	u64 n = bio_sectors(dd_bio(io)) / DD_SECTORS_PER_BLOCK, unmapped = 0;
	u64 next = io->lba, end = io->lba + n;
	struct dd_md_freed freed[8];
	unsigned int nr, i;
	int r = -EIO;

	down_write(&dc->lock);
	if (READ_ONCE(dc->mode) == DD_MODE_RW) {
		do {
			r = dd_md_unmap_range(dc->md, next, end, freed,
					      ARRAY_SIZE(freed), &nr, &next,
					      &unmapped);
			for (i = 0; i < nr; i++)
				dd_index_forget(dc, &freed[i]);
		} while (!r && next < end);
		if (r)
			dd_metadata_error(dc, "discard", r);
		else
			dd_check_writeback(dc);
	}
	up_write(&dc->lock);
	/* As for writes, FUA means durable on completion. */
	dd_finish_write(dc, io, r);
}

/* ------------------------------------------------------------------ */
/* target methods */

/*
 * Reads and writes map one logical block to one physical block whole. The
 * queue limits (logical block size 4 KiB, max_io_len) make every bio one
 * aligned block; a bio queued under an older table with other limits, or
 * from a misbehaving submitter, is refused rather than half mapped.
 */
static bool dd_bio_is_one_block(struct dedup_c *dc, struct bio *bio)
{
	if (likely(bio_sectors(bio) == DD_SECTORS_PER_BLOCK &&
		   !(bio->bi_iter.bi_sector & (DD_SECTORS_PER_BLOCK - 1))))
		return true;
	DMERR_LIMIT("%s: refused a %u-byte %s at sector %llu: not one aligned 4 KiB block",
		    dd_name(dc), bio->bi_iter.bi_size,
		    op_is_write(bio_op(bio)) ? "write" : "read",
		    (unsigned long long)bio->bi_iter.bi_sector);
	return false;
}

static int dedup_map(struct dm_target *ti, struct bio *bio)
{
	struct dedup_c *dc = ti->private;
	struct dd_io *io = dm_per_bio_data(bio, sizeof(*io));

	io->dc = dc;
	io->flags = 0;
	io->status = BLK_STS_OK;
	io->data = NULL;
	INIT_LIST_HEAD(&io->wait_entry);

	if (bio->bi_opf & REQ_PREFLUSH) {
		/* dm core hands us flushes without data. */
		dd_defer_to_commit(dc, bio);
		return DM_MAPIO_SUBMITTED;
	}

	io->lba = dm_target_offset(ti, bio->bi_iter.bi_sector) /
		  DD_SECTORS_PER_BLOCK;
	switch (bio_op(bio)) {
	case REQ_OP_READ:
		if (!dd_bio_is_one_block(dc, bio))
			return DM_MAPIO_KILL;
		return dd_map_read(dc, io);
	case REQ_OP_WRITE:
		if (!dd_bio_is_one_block(dc, bio))
			return DM_MAPIO_KILL;
		io->data = dd_data_copy(&dc->data_pool, bio);
		INIT_WORK(&io->work, dd_write_work);
		break;
	case REQ_OP_DISCARD:
	case REQ_OP_WRITE_ZEROES:
		INIT_WORK(&io->work, dd_discard_work);
		break;
	default:
		return DM_MAPIO_KILL;
	}
	queue_work(dc->wq, &io->work);
	return DM_MAPIO_SUBMITTED;
}

static int dedup_end_io(struct dm_target *ti, struct bio *bio,
			blk_status_t *error)
{
	struct dedup_c *dc = ti->private;
	struct dd_io *io = dm_per_bio_data(bio, sizeof(*io));

	if ((io->flags & DD_IO_READ_TRACKED) &&
	    atomic_dec_and_test(&dc->reads_inflight))
		wake_up(&dc->reads_wait);
	return DM_ENDIO_DONE;
}

static void dedup_status(struct dm_target *ti, status_type_t type,
			 unsigned int status_flags, char *result,
			 unsigned int maxlen)
{
	struct dedup_c *dc = ti->private;
	struct dd_md_stats st;
	unsigned int sz = 0, nr_opts;

	switch (type) {
	case STATUSTYPE_INFO:
		if (!dc->md) {
			/* A reloaded table before its first resume. */
			DMEMIT("inactive");
			break;
		}
		down_read(&dc->lock);
		dd_md_stats(dc->md, &st);
		up_read(&dc->lock);
		DMEMIT("%s %llu %llu/%llu %llu/%llu %llu %llu %llu %llu %llu %s %s %s",
		       dd_mode_names[READ_ONCE(dc->mode)], st.transaction_id,
		       st.metadata_used, st.metadata_total, st.data_used,
		       st.data_total, st.mapped, st.unique_writes,
		       st.duplicate_writes, st.zero_writes, st.discarded,
		       dd_hasher_name(&dc->hasher),
		       dc->verify ? "verify" : "no_verify",
		       dc->discard_passdown ? "discard_passdown" :
					      "no_discard_passdown");
		break;
	case STATUSTYPE_TABLE:
		nr_opts = 2 * !!strcmp(dd_hasher_name(&dc->hasher),
				       DD_DEFAULT_HASH) +
			  dc->verify +
			  2 * (dc->commit_interval != DD_DEFAULT_COMMIT_INTERVAL) +
			  dc->discard_passdown + 2 * !!dc->low_water_mark +
			  dc->read_only;
		DMEMIT("%s %s", dc->meta_dev->name, dc->data_dev->name);
		if (nr_opts)
			DMEMIT(" %u", nr_opts);
		if (strcmp(dd_hasher_name(&dc->hasher), DD_DEFAULT_HASH))
			DMEMIT(" hash %s", dd_hasher_name(&dc->hasher));
		if (dc->verify)
			DMEMIT(" verify");
		if (dc->commit_interval != DD_DEFAULT_COMMIT_INTERVAL)
			DMEMIT(" commit_interval %u", dc->commit_interval);
		if (dc->discard_passdown)
			DMEMIT(" discard_passdown");
		if (dc->low_water_mark)
			DMEMIT(" low_water_mark %llu", dc->low_water_mark);
		if (dc->read_only)
			DMEMIT(" read_only");
		break;
	case STATUSTYPE_IMA:
		*result = '\0';
		break;
	}
}

static int dd_message_stats(struct dedup_c *dc, char *result,
			    unsigned int maxlen)
{
	u64 index_bytes = dd_index_bytes(&dc->index);
	unsigned int sz = 0;
	struct dd_md_stats st;
	u64 written;

	down_read(&dc->lock);
	dd_md_stats(dc->md, &st);
	up_read(&dc->lock);
	written = st.unique_writes + st.duplicate_writes + st.zero_writes;

	DMEMIT("mode %s\n", dd_mode_names[READ_ONCE(dc->mode)]);
	DMEMIT("transaction_id %llu\n", st.transaction_id);
	DMEMIT("logical_blocks %llu\n", dc->logical_blocks);
	DMEMIT("mapped_blocks %llu\n", st.mapped);
	DMEMIT("data_blocks_total %llu\n", st.data_total);
	DMEMIT("data_blocks_used %llu\n", st.data_used);
	DMEMIT("data_blocks_live %llu\n", st.data_live);
	DMEMIT("data_blocks_pending_free %llu\n", st.pending_free);
	DMEMIT("metadata_blocks_total %llu\n", st.metadata_total);
	DMEMIT("metadata_blocks_used %llu\n", st.metadata_used);
	DMEMIT("unique_writes %llu\n", st.unique_writes);
	DMEMIT("duplicate_writes %llu\n", st.duplicate_writes);
	DMEMIT("zero_writes %llu\n", st.zero_writes);
	DMEMIT("discarded_blocks %llu\n", st.discarded);
	/* Percentages in hundredths, to stay in integer arithmetic. */
	DMEMIT("dedup_ratio_x100 %llu\n",
	       st.data_live ? div64_u64(st.mapped * 100, st.data_live) : 100);
	DMEMIT("write_savings_x100 %llu\n",
	       written ? div64_u64((written - st.unique_writes) * 10000,
				   written) : 0);
	DMEMIT("index_bytes %llu\n", index_bytes);
	DMEMIT("index_bytes_per_data_block_x100 %llu\n",
	       div64_u64(index_bytes * 100, st.data_total));
	DMEMIT("index_entries %llu\n", dc->index.nr_entries);
	DMEMIT("index_full %lld\n", atomic64_read(&dc->index_full));
	DMEMIT("verify_mismatches %lld\n",
	       atomic64_read(&dc->verify_mismatches));
	DMEMIT("nospc_errors %lld\n", atomic64_read(&dc->nospc_errors));
	DMEMIT("data_write_errors %lld\n",
	       atomic64_read(&dc->data_write_errors));
	DMEMIT("deferred_reads %lld\n", atomic64_read(&dc->deferred_reads));
	DMEMIT("discard_passdown_blocks %lld\n",
	       atomic64_read(&dc->discard_passdown_blocks));
	DMEMIT("hash %s\n", dd_hasher_name(&dc->hasher));
	return 1;
}

static int dedup_message(struct dm_target *ti, unsigned int argc, char **argv,
			 char *result, unsigned int maxlen)
{
	struct dedup_c *dc = ti->private;

	if (!dc->md)
		return -EINVAL;
	if (argc == 1 && !strcasecmp(argv[0], "stats"))
		return dd_message_stats(dc, result, maxlen);
	if (argc == 1 && !strcasecmp(argv[0], "commit"))
		return dd_commit(dc);
	DMERR("%s: unknown message (expected: stats, commit)", dd_name(dc));
	return -EINVAL;
}

static void dedup_io_hints(struct dm_target *ti, struct queue_limits *limits)
{
	limits->logical_block_size = DD_BLOCK_SIZE;
	limits->physical_block_size = DD_BLOCK_SIZE;
	limits->io_min = DD_BLOCK_SIZE;
	limits->discard_granularity = DD_BLOCK_SIZE;
	limits->max_hw_discard_sectors = DD_MAX_DISCARD_SECTORS;
	limits->max_write_zeroes_sectors = DD_MAX_DISCARD_SECTORS;
}

static int dedup_iterate_devices(struct dm_target *ti,
				 iterate_devices_callout_fn fn, void *data)
{
	struct dedup_c *dc = ti->private;

	/*
	 * Only the data device holds what the logical blocks read, and it
	 * may be smaller than the logical size.
	 */
	return fn(ti, dc->data_dev, 0, dc->data_blocks * DD_SECTORS_PER_BLOCK,
		  data);
}

static void dedup_postsuspend(struct dm_target *ti)
{
	struct dedup_c *dc = ti->private;

	if (!dc->md)
		return;
	cancel_delayed_work_sync(&dc->periodic_commit);
	flush_workqueue(dc->wq);
	flush_workqueue(dc->commit_wq);
	dd_commit(dc);
}

static int dd_open_metadata(struct dedup_c *dc, struct dm_target *ti,
			    bool identity_only, char **error);

/*
 * A reloaded table opens the metadata only now: the table it replaces was
 * suspended, so everything it wrote is committed.
 */
static int dedup_preresume(struct dm_target *ti)
{
	struct dedup_c *dc = ti->private;
	char *error = NULL;
	int r;

	if (dc->md)
		return 0;
	r = dd_open_metadata(dc, ti, false, &error);
	if (r)
		DMERR("%s: cannot open the metadata: %s", dd_name(dc),
		      error ? error : "error");
	return r;
}

static void dedup_resume(struct dm_target *ti)
{
	struct dedup_c *dc = ti->private;

	if (!dc->read_only)
		queue_delayed_work(dc->commit_wq, &dc->periodic_commit,
				   dc->commit_interval * HZ);
}

/* ------------------------------------------------------------------ */
/* construction */

static int dd_parse_options(struct dedup_c *dc, struct dm_arg_set *as,
			    const char **hash, char **error)
{
	static const struct dm_arg nr_opts = {0, 9, "Invalid number of optional arguments"};
	static const struct dm_arg interval = {1, DD_MAX_COMMIT_INTERVAL,
		"Invalid commit_interval (seconds, 1-3600)"};
	unsigned int count;
	const char *opt;
	int r;

	if (!as->argc)
		return 0;
	r = dm_read_arg_group(&nr_opts, as, &count, error);
	if (r)
		return r;
	if (as->argc != count) {
		*error = "Too many arguments (more than the optional argument count says)";
		return -EINVAL;
	}
	while (count--) {
		opt = dm_shift_arg(as);
		if (!strcasecmp(opt, "verify")) {
			dc->verify = true;
		} else if (!strcasecmp(opt, "discard_passdown")) {
			dc->discard_passdown = true;
		} else if (!strcasecmp(opt, "read_only")) {
			dc->read_only = true;
		} else if (!strcasecmp(opt, "hash") && count) {
			*hash = dm_shift_arg(as);
			count--;
		} else if (!strcasecmp(opt, "commit_interval") && count) {
			r = dm_read_arg(&interval, as, &dc->commit_interval,
					error);
			if (r)
				return r;
			count--;
		} else if (!strcasecmp(opt, "low_water_mark") && count) {
			if (kstrtoull(dm_shift_arg(as), 10, &dc->low_water_mark)) {
				*error = "Invalid low_water_mark (a number of data blocks)";
				return -EINVAL;
			}
			count--;
		} else {
			*error = "Unknown or incomplete optional argument";
			return -EINVAL;
		}
	}
	return 0;
}

/*
 * The claim on the devices goes last: until the metadata is closed, and
 * with it every write of this instance done, no other target may open it.
 */
static void dd_destroy(struct dedup_c *dc)
{
	if (dc->commit_wq)
		destroy_workqueue(dc->commit_wq);
	if (dc->wq)
		destroy_workqueue(dc->wq);
	if (dc->md)
		dd_md_close(dc->md);
	dd_index_exit(&dc->index);
	dd_hasher_exit(&dc->hasher);
	dd_data_pool_exit(&dc->data_pool);
	bioset_exit(&dc->bs);
	if (dc->data_dev)
		dm_put_device(dc->ti, dc->data_dev);
	mutex_lock(&dd_instances_lock);
	list_del(&dc->instance);
	mutex_unlock(&dd_instances_lock);
	if (dc->meta_dev)
		dm_put_device(dc->ti, dc->meta_dev);
	kfree(dc);
}

static int dd_open_devices(struct dedup_c *dc, struct dm_target *ti,
			   char **argv)
{
	blk_mode_t mode = dc->read_only ? BLK_OPEN_READ :
			  dm_table_get_mode(ti->table);
	int r;

	r = dm_get_device(ti, argv[0], mode, &dc->meta_dev);
	if (r) {
		ti->error = "Cannot open metadata device";
		return r;
	}
	r = dm_get_device(ti, argv[1], mode, &dc->data_dev);
	if (r) {
		ti->error = "Cannot open data device";
		return r;
	}
	if (dc->meta_dev->bdev == dc->data_dev->bdev) {
		ti->error = "Metadata and data devices must differ";
		return -EINVAL;
	}
	dc->data_blocks = bdev_nr_bytes(dc->data_dev->bdev) >> DD_BLOCK_SHIFT;
	if (!dc->data_blocks) {
		ti->error = "Data device is smaller than one 4 KiB block";
		return -EINVAL;
	}
	if (dc->data_blocks - 1 > DD_INDEX_MAX_PBA) {
		ti->error = "Data device too large (at most 2^40 - 1 blocks)";
		return -EINVAL;
	}
	return 0;
}

static int dd_open_metadata(struct dedup_c *dc, struct dm_target *ti,
			    bool identity_only, char **error)
{
	struct dd_md_config cfg = {
		.logical_blocks = dc->logical_blocks,
		.data_blocks = dc->data_blocks,
		.hash_name = dd_hasher_name(&dc->hasher),
		.fp_size = dc->hasher.fp_size,
		.read_only = dc->read_only,
		.identity_only = identity_only,
		.visit = dd_index_visit,
		.ctx = dc,
	};
	struct dd_metadata *md;
	int r;

	if (identity_only) {
		r = dd_md_open(dc->meta_dev->bdev, &cfg, &md, error);
		if (!r)
			dd_md_close(md);
		return r;
	}

	r = dd_index_init(&dc->index, dc->data_blocks);
	if (r) {
		DMERR("cannot allocate the fingerprint index: %llu MiB",
		      (u64)(dc->data_blocks + dc->data_blocks / 4) * 8 >> 20);
		*error = "Cannot allocate the fingerprint index";
		return r;
	}
	r = dd_md_open(dc->meta_dev->bdev, &cfg, &dc->md, error);
	if (r)
		dd_index_exit(&dc->index);
	return r;
}

/* Called with dd_instances_lock held. */
static int dd_claim_devices(struct dedup_c *dc, bool *reload)
{
	struct mapped_device *md = dm_table_get_md(dc->ti->table);
	struct block_device *meta = dc->meta_dev->bdev;
	struct block_device *data = dc->data_dev->bdev;
	struct dedup_c *other;

	*reload = false;
	list_for_each_entry(other, &dd_instances, instance) {
		bool same_meta = other->meta_dev->bdev == meta;

		if (!same_meta && other->data_dev->bdev != data &&
		    other->meta_dev->bdev != data && other->data_dev->bdev != meta)
			continue;
		if (dm_table_get_md(other->ti->table) != md || !same_meta ||
		    other->data_dev->bdev != data) {
			dc->ti->error = "Device already in use by another dedup target";
			return -EBUSY;
		}
		*reload = true;
	}
	return 0;
}

/*
 * <metadata dev> <data dev> [<#opt args> [hash <alg>] [verify]
 *   [commit_interval <s>] [discard_passdown] [low_water_mark <blocks>]
 *   [read_only]]
 */
static int dedup_ctr(struct dm_target *ti, unsigned int argc, char **argv)
{
	struct dm_arg_set as = { .argc = argc - 2, .argv = argv + 2 };
	const char *hash = DD_DEFAULT_HASH;
	struct dedup_c *dc;
	bool reload;
	int r;

	if (argc < 2) {
		ti->error = "Missing arguments: <metadata dev> <data dev> [<#opt args> ...]";
		return -EINVAL;
	}
	if (ti->begin % DD_SECTORS_PER_BLOCK || ti->len % DD_SECTORS_PER_BLOCK ||
	    !ti->len) {
		ti->error = "Start and length must be non-zero multiples of 8 sectors (4 KiB)";
		return -EINVAL;
	}
	dc = kzalloc(sizeof(*dc), GFP_KERNEL);
	if (!dc) {
		ti->error = "Out of memory";
		return -ENOMEM;
	}
	dc->ti = ti;
	INIT_LIST_HEAD(&dc->instance);
	dc->commit_interval = DD_DEFAULT_COMMIT_INTERVAL;
	dc->logical_blocks = ti->len / DD_SECTORS_PER_BLOCK;
	init_rwsem(&dc->lock);
	hash_init(dc->inflight);
	spin_lock_init(&dc->commit_lock);
	bio_list_init(&dc->commit_waiters);
	INIT_LIST_HEAD(&dc->nospc_waiters);
	atomic_set(&dc->reads_inflight, 0);
	init_waitqueue_head(&dc->reads_wait);
	INIT_WORK(&dc->commit_work, dd_commit_work);
	INIT_DELAYED_WORK(&dc->periodic_commit, dd_periodic_commit);
	INIT_WORK(&dc->abort_work, dd_abort_work);

	r = dd_parse_options(dc, &as, &hash, &ti->error);
	if (r)
		goto bad;
	dc->mode = dc->read_only ? DD_MODE_RO : DD_MODE_RW;
	r = dd_hasher_init(&dc->hasher, hash, &ti->error);
	if (r)
		goto bad;
	if (!dc->hasher.strong && !dc->verify) {
		ti->error = "Hash is not collision resistant: add the 'verify' option to use it";
		r = -EINVAL;
		goto bad;
	}
	r = dd_open_devices(dc, ti, argv);
	if (r)
		goto bad;
	r = bioset_init(&dc->bs, 256, 0, BIOSET_NEED_BVECS);
	if (r) {
		ti->error = "Cannot allocate bio set";
		goto bad;
	}
	r = dd_data_pool_init(&dc->data_pool, DD_DATA_RESERVE);
	if (r) {
		ti->error = "Cannot allocate the reserve of data block copies";
		goto bad;
	}
	mutex_lock(&dd_instances_lock);
	r = dd_claim_devices(dc, &reload);
	if (!r)
		r = dd_open_metadata(dc, ti, reload, &ti->error);
	if (!r)
		list_add(&dc->instance, &dd_instances);
	mutex_unlock(&dd_instances_lock);
	if (r)
		goto bad;
	dc->wq = alloc_workqueue("dedup-io", WQ_UNBOUND | WQ_MEM_RECLAIM, 0);
	dc->commit_wq = alloc_ordered_workqueue("dedup-commit", WQ_MEM_RECLAIM);
	if (!dc->wq || !dc->commit_wq) {
		ti->error = "Cannot allocate workqueues";
		r = -ENOMEM;
		goto bad;
	}

	ti->private = dc;
	ti->num_flush_bios = 1;
	ti->flush_supported = true;
	ti->num_discard_bios = 1;
	ti->discards_supported = true;
	ti->num_write_zeroes_bios = 1;
	ti->per_io_data_size = sizeof(struct dd_io);
	r = dm_set_target_max_io_len(ti, DD_SECTORS_PER_BLOCK);
	if (r)
		goto bad;
	DMINFO("%s: %llu logical blocks over %llu data blocks, index %zu KiB, hash %s%s%s",
	       dd_name(dc), dc->logical_blocks, dc->data_blocks,
	       dd_index_bytes(&dc->index) >> 10, dd_hasher_name(&dc->hasher),
	       dc->verify ? ", verify" : "", dc->read_only ? ", read-only" : "");
	return 0;
bad:
	dd_destroy(dc);
	return r;
}

static void dedup_dtr(struct dm_target *ti)
{
	struct dedup_c *dc = ti->private;

	cancel_delayed_work_sync(&dc->periodic_commit);
	flush_workqueue(dc->wq);
	flush_workqueue(dc->commit_wq);
	if (dc->md && dd_commit(dc))
		DMERR("%s: final commit failed; the device reopens at its last commit",
		      dd_name(dc));
	dd_destroy(dc);
}

static struct target_type dedup_target = {
	.name = "dedup",
	.version = {1, 0, 0},
	.module = THIS_MODULE,
	.ctr = dedup_ctr,
	.dtr = dedup_dtr,
	.map = dedup_map,
	.end_io = dedup_end_io,
	.postsuspend = dedup_postsuspend,
	.preresume = dedup_preresume,
	.resume = dedup_resume,
	.status = dedup_status,
	.message = dedup_message,
	.io_hints = dedup_io_hints,
	.iterate_devices = dedup_iterate_devices,
};

static int __init dm_dedup_init(void)
{
	return dm_register_target(&dedup_target);
}

static void __exit dm_dedup_exit(void)
{
	dm_unregister_target(&dedup_target);
}

module_init(dm_dedup_init);
module_exit(dm_dedup_exit);

MODULE_DESCRIPTION(DM_NAME " target deduplicating 4 KiB blocks inline");
MODULE_LICENSE("GPL");
