// SPDX-License-Identifier: GPL-2.0-only
/*
 * The life of a bio. A read is remapped through the map, without a worker
 * when its entry is cached. A write is copied into a page we own, tested
 * for zeros and hashed without any lock, on an unbound workqueue so that
 * hashing spreads over all CPUs; dedup-decide.c then maps it, or hands
 * back a block for the data, written here. Flushes and FUA writes
 * complete at the next commit (dedup-commit.c).
 */
#define DM_MSG_PREFIX "dedup"

#include <linux/highmem.h>

#include "dedup-target.h"

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

/* ------------------------------------------------------------------ */
/* reads */

static int dd_read_lookup(struct dedup_c *dc, struct dd_io *io, bool nowait)
{
	struct bio *bio = dd_bio(io);
	u64 pba;
	int r;

	lockdep_assert_held_read(&dc->lock);
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
		if (r == -EILSEQ || r == -ESTALE)
			dd_metadata_error_shared(dc, "map lookup", r);
		dd_endio(bio, BLK_STS_IOERR);
		return DM_MAPIO_SUBMITTED;
	}
	dd_read_track(dc, io);
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

	if (io->status)
		atomic64_inc(&dc->data_write_errors);
	dd_finish_write(dc, io, dd_decide_stored(dc, io));
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

/*
 * The write's work: the front end once, then the decision, again each
 * time the write was parked (dedup-decide.c and dedup-commit.c queue this
 * same work).
 */
static void dd_write_work(struct work_struct *w)
{
	struct dd_io *io = container_of(w, struct dd_io, work);
	struct dedup_c *dc = io->dc;
	void *p;
	int r = 0;

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
	switch (dd_decide_write(dc, io, &r)) {
	case DD_DONE:
		dd_finish_write(dc, io, r);
		break;
	case DD_STORE:
		dd_submit_unique(dc, io);
		break;
	case DD_PARKED:
		break;
	}
}

/* ------------------------------------------------------------------ */
/* discard and write zeroes */

static void dd_discard_work(struct work_struct *w)
{
	struct dd_io *io = container_of(w, struct dd_io, work);
	struct dedup_c *dc = io->dc;
	u64 n = bio_sectors(dd_bio(io)) / DD_SECTORS_PER_BLOCK;

	/* As for writes, FUA means durable on completion. */
	dd_finish_write(dc, io, dd_decide_unmap(dc, io->lba, io->lba + n));
}

/* ------------------------------------------------------------------ */
/* entry points */

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

int dd_io_map(struct dedup_c *dc, struct bio *bio)
{
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

	io->lba = dm_target_offset(dc->ti, bio->bi_iter.bi_sector) /
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

void dd_io_end(struct dedup_c *dc, struct bio *bio)
{
	dd_read_untrack(dc, dm_per_bio_data(bio, sizeof(struct dd_io)));
}
