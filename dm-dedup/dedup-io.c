// SPDX-License-Identifier: GPL-2.0-only
/*
 * The life of a bio. A read is remapped through the map a run of blocks
 * at a time, without a worker when the map is cached. A write of up to
 * DD_BIO_BLOCKS blocks is copied into pages we own, tested for zeros and
 * hashed without any lock, in chunks on an unbound workqueue so that
 * hashing spreads over all CPUs (with early_ack, one-block writes in
 * batches instead: dd_hash_batch_work); dedup-decide.c then decides all its
 * blocks in one pass, mapping duplicates and handing back runs of
 * physical blocks for new data, written here one bio per run. One work
 * item per device submits the runs of concurrent writes together (a
 * write alone in flight submits its own), and one maps those whose data
 * writes completed, each a batch at a time.
 * Flushes and FUA writes complete at the next commit (dedup-commit.c).
 * With early_ack, a write is acknowledged before it is done, before it
 * is decided if it can be: see "writes acknowledged early" below.
 */
#define DM_MSG_PREFIX "dedup"

#include <linux/blk-cgroup.h>
#include <linux/cgroup.h>
#include <linux/highmem.h>
#include <linux/sort.h>

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

/*
 * A write, discard or write zeroes is done with @r, its changes going
 * with append @append, and the next change to its blocks may go ahead
 * (the caller left its cell).
 */
static void dd_complete_change(struct dedup_c *dc, struct bio *bio, int r,
			       u64 append)
{
	if (r == -EROFS)
		r = -EIO;
	dd_change_acked(dc, append);
	if (!r && (bio->bi_opf & REQ_FUA)) {
		/* Durable when it completes: the commit completes it. */
		dd_defer_to_commit(dc, bio);
		return;
	}
	dd_endio(bio, dd_errno_to_status(r));
}

/* ------------------------------------------------------------------ */
/* reads */

/*
 * A run of blocks looked up (dd_md_lookup_run returned @r): unmapped ones
 * read as zeros, mapped ones go to the data device in one piece.
 */
static int dd_read_run(struct dedup_c *dc, struct dd_io *io, int r, u64 pba)
{
	struct bio *bio = dd_bio(io);

	lockdep_assert_held_read(&dc->lock);
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

/* The worker reads one block: dd_map_read cut the bio to that. */
static void dd_read_work(struct work_struct *w)
{
	struct dd_io *io = container_of(w, struct dd_io, work);
	struct dedup_c *dc = io->dc;
	u64 pba = 0;
	int r;

	down_read(&dc->lock);
	r = dd_md_lookup(dc->md, io->lba, &pba, false);
	/*
	 * Looked up: a later write may go ahead. Before dd_read_run(), which
	 * may end the bio and free @io with its cell; the block it found
	 * cannot be reused before the read is tracked, under the lock held.
	 */
	if (io->flags & DD_IO_READ_BEHIND)
		dd_cell_leave(&dc->cells, &io->cell);
	r = dd_read_run(dc, io, r, pba);
	up_read(&dc->lock);
	if (r == DM_MAPIO_REMAPPED)
		dm_submit_bio_remap(dd_bio(io), NULL);
}

static void dd_io_turn_ready(struct dd_cell *cell)
{
	struct dd_io *io = container_of(cell, struct dd_io, cell);

	queue_work(io->dc->wq, &io->work);
}

/*
 * A write acknowledged early may not be mapped yet: a read of its blocks
 * waits for it, one block at a time (dm core sends the rest of the bio
 * again). Only while such writes are in flight; without them a read that
 * races a write may return either content, as on any disk.
 */
static bool dd_read_behind_write(struct dedup_c *dc, struct dd_io *io)
{
	struct bio *bio = dd_bio(io);
	unsigned int nr = bio_sectors(bio) / DD_SECTORS_PER_BLOCK;

	if (likely(!READ_ONCE(dc->acked_blocks)))
		return false;
	if (!dd_cells_busy(&dc->cells, io->lba, io->lba + nr))
		return false;
	/* Before the cell is entered: its ready function owns the bio. */
	if (nr > 1)
		dm_accept_partial_bio(bio, DD_SECTORS_PER_BLOCK);
	INIT_WORK(&io->work, dd_read_work);
	/* Before the cell is entered: its worker may run at once. */
	io->flags |= DD_IO_READ_BEHIND;
	if (!dd_cell_enter_behind(&dc->cells, &io->cell, io->lba, io->lba + 1,
				  dd_io_turn_ready)) {
		io->flags &= ~DD_IO_READ_BEHIND;
		return false;	/* the write to this block left meanwhile */
	}
	return true;
}

/*
 * Under load, a remapped read is not submitted from the map function: it
 * joins a queue that one work item submits a batch at a time under one
 * plug, so that the device gets the batch with one doorbell where direct
 * submission rings it for every read (on a virtio disk a doorbell is a
 * trap to the hypervisor; dm-vdo submits all its I/O from its own threads
 * and gains the same). The worker's wakeup adds latency, which only large
 * batches repay: batching every read that had another in flight halved
 * the rate of 4 KiB reads at iodepth 4 under TCG (batches of 1.7 reads)
 * and more than doubled it at iodepth 32 (batches of 5 and more).
 *
 * Direct submission keeps few reads in flight, so the depth seen here
 * understates the load while reads go out at once; the decision therefore
 * has two states. Reads go out at once until more than
 * DD_READ_BATCH_ENTER are in flight; from then on every read that has
 * another in flight is batched, until the recent batches carry fewer than
 * DD_READ_BATCH_LEAVE (2.5) reads on average, the sign that the load has
 * fallen. Under TCG this left iodepth 1 and 4 level with direct
 * submission (8 within the spread of two runs) and took iodepth 16 and 32
 * from 28 to 45 and 66 MiB/s; one threshold on the depth alone (the rule
 * before) seldom saw more than 8.
 */
#define DD_READ_BATCH_ENTER	4
/* dc->read_batch_avg is fixed point, in sixteenths of a read */
#define DD_READ_AVG_SHIFT	4
#define DD_READ_BATCH_LEAVE	(5 << (DD_READ_AVG_SHIFT - 1))
/* where the average starts: a new batching state gets a few batches */
#define DD_READ_AVG_START	(4 << DD_READ_AVG_SHIFT)

static void dd_read_batch_work(struct work_struct *work)
{
	struct dedup_c *dc = container_of(work, struct dedup_c, read_work);
	struct llist_node *node = llist_del_all(&dc->to_read);
	struct dd_io *io, *next;
	struct blk_plug plug;
	unsigned int nr = 0, avg;

	blk_start_plug(&plug);
	llist_for_each_entry_safe(io, next, llist_reverse_order(node),
				  read_node) {
		dm_submit_bio_remap(dd_bio(io), NULL);
		nr++;
	}
	blk_finish_plug(&plug);
	atomic64_inc(&dc->read_batches);
	atomic64_add(nr, &dc->batched_reads);
	/*
	 * A work item never runs twice at once: the average's only writer.
	 * Each batch weighs a quarter; in unsigned terms, so that a batch
	 * below the average cannot wrap it around.
	 */
	avg = dc->read_batch_avg;
	avg = avg - avg / 4 + (nr << (DD_READ_AVG_SHIFT - 2));
	if (avg < DD_READ_BATCH_LEAVE) {
		WRITE_ONCE(dc->read_batching, false);
		avg = DD_READ_AVG_START;
	}
	dc->read_batch_avg = avg;
}

/* A read remapped in the map function (and tracked): now, or batched. */
static int dd_read_go(struct dedup_c *dc, struct dd_io *io)
{
	unsigned int n;

	if (dc->no_read_batching)
		return DM_MAPIO_REMAPPED;
	n = dd_reads_in_flight(dc);
	if (!READ_ONCE(dc->read_batching)) {
		if (n <= DD_READ_BATCH_ENTER)
			return DM_MAPIO_REMAPPED;
		WRITE_ONCE(dc->read_batching, true);
	} else if (n < 2) {
		return DM_MAPIO_REMAPPED;
	}
	if (llist_add(&io->read_node, &dc->to_read))
		queue_work(dc->read_wq, &dc->read_work);
	return DM_MAPIO_SUBMITTED;
}

/*
 * A read takes the run of blocks at its start that reads from one place
 * (dm core sends the rest of the bio to us again), without a worker when
 * the map is in the cache; otherwise a worker reads the map for its first
 * block.
 */
static int dd_map_read(struct dedup_c *dc, struct dd_io *io)
{
	struct bio *bio = dd_bio(io);
	u64 pba = 0, nr = 1;
	int r = -EWOULDBLOCK;

	if (dd_read_behind_write(dc, io))
		return DM_MAPIO_SUBMITTED;
	if (down_read_trylock(&dc->lock)) {
		r = dd_md_lookup_run(dc->md, io->lba,
				     bio_sectors(bio) / DD_SECTORS_PER_BLOCK,
				     &pba, &nr, true);
		if (r != -EWOULDBLOCK) {
			if (nr * DD_SECTORS_PER_BLOCK < bio_sectors(bio))
				dm_accept_partial_bio(bio,
						      nr * DD_SECTORS_PER_BLOCK);
			r = dd_read_run(dc, io, r, pba);
		}
		up_read(&dc->lock);
	}
	if (r == DM_MAPIO_REMAPPED)
		return dd_read_go(dc, io);
	if (r != -EWOULDBLOCK)
		return r;
	if (bio_sectors(bio) > DD_SECTORS_PER_BLOCK)
		dm_accept_partial_bio(bio, DD_SECTORS_PER_BLOCK);
	atomic64_inc(&dc->deferred_reads);
	INIT_WORK(&io->work, dd_read_work);
	queue_work(dc->wq, &io->work);
	return DM_MAPIO_SUBMITTED;
}

/* ------------------------------------------------------------------ */
/* writes */

/*
 * Blocks hashed per work item: the blocks of a large write are hashed on
 * several CPUs at once.
 */
#define DD_HASH_CHUNK		8
/* What a data bio keeps of its write's flags. */
#define DD_DATA_HINTS		(REQ_SYNC | REQ_META | REQ_PRIO | REQ_IDLE | \
				 REQ_BACKGROUND)

static void dd_acked_done(struct dedup_c *dc, unsigned int nr, int r);

/* Every block of the write is done: complete the bio. */
static void dd_write_done(struct dd_write *w)
{
	struct dedup_c *dc = w->dc;
	struct bio *bio = w->bio;
	unsigned int nr = w->nr;
	int r = READ_ONCE(w->error);
	u64 append = atomic64_read(&w->append);

	if (w->pooled)
		mempool_free(w->blk, &dc->batch_pool);
	else if (w->blk != &w->one)
		kfree(w->blk);
	/* Mapped: a read or a later change of its blocks may go ahead. */
	dd_cell_leave(&dc->cells, &w->cell);
	if (w->css)
		css_put(w->css);
	mempool_free(w, &dc->write_pool);
	/* Before the bio completes, which may bring its flush request. */
	if (atomic_dec_and_test(&dc->writes_inflight))
		dd_writes_idle(dc);
	if (bio)
		dd_complete_change(dc, bio, r, append);
	else
		dd_acked_done(dc, nr, r);
}

/* A reference on the write's blocks: they stay until the last is put. */
static void dd_write_put(struct dd_write *w)
{
	if (atomic_dec_and_test(&w->pending))
		dd_write_done(w);
}

/* The block is done with @r; the first error of a block fails the write. */
static void dd_block_done(struct dedup_c *dc, struct dd_write_block *b, int r)
{
	struct dd_write *w = b->w;

	/* A stored block's page may have been kept (dd_decide_stored_runs). */
	if (b->data)
		dd_data_put(&dc->data_pool, b->data);
	b->data = NULL;
	if (r)
		cmpxchg(&w->error, 0, r);
	dd_write_put(w);
}

static void dd_run_finish(struct dedup_c *dc, struct dd_write_block *b)
{
	struct dd_write_block *next;

	for (; b; b = next) {
		next = b->run_next;
		dd_block_done(dc, b, b->error);
	}
}

/*
 * The runs whose data write completed, mapped a batch at a time: one
 * work item for all of them, not one per run, and the runs that complete
 * while a batch is mapped share its trips through the locks. Only one
 * instance of a work item runs at a time, so this is the one mapper of
 * new data; an endio queues it again if it is running.
 */
static void dd_stored_work(struct work_struct *work)
{
	struct dedup_c *dc = container_of(work, struct dedup_c, stored_work);
	struct llist_node *node = llist_reverse_order(llist_del_all(&dc->stored));
	struct dd_write_block *runs[DD_STORED_RUNS];
	unsigned int nr, blocks, len, done, i;
	bool fua;

	while (node) {
		nr = 0;
		blocks = 0;
		fua = false;
		while (node && nr < DD_STORED_RUNS) {
			runs[nr] = llist_entry(node, struct dd_write_block,
					       run_node);
			len = dd_run_len(runs[nr]);
			if (nr && blocks + len > DD_STORED_BLOCKS)
				break;
			blocks += len;
			fua |= runs[nr]->w->fua;
			nr++;
			node = node->next;
		}
		/* Its append needs the data flushed: start that now. */
		if (fua)
			dd_fua_data_written(dc);
		done = dd_decide_stored_runs(dc, runs, nr);
		for (i = 0; i < done; i++)
			dd_run_finish(dc, runs[i]);
		cond_resched();
	}
}

/* A run that waited for a commit (dd_data_covered) is mapped again. */
static void dd_run_done_work(struct work_struct *work)
{
	struct dd_write_block *b = container_of(work, struct dd_write_block, work);
	struct dedup_c *dc = b->w->dc;

	if (dd_decide_stored(dc, b, b->error))
		dd_run_finish(dc, b);
}

static void dd_run_endio(struct bio *clone)
{
	struct dd_write_block *run = clone->bi_private;
	struct dedup_c *dc = run->w->dc;

	run->error = blk_status_to_errno(clone->bi_status);
	/*
	 * A failed write left nothing for a flush to cover, and its run is
	 * not mapped: no ticket, and not counted, so that no flush is sent
	 * ahead for it alone, whose failure on a failing device would then
	 * fail the next append (dd_flush_ahead).
	 */
	if (run->error)
		atomic64_inc(&dc->data_write_errors);
	else
		run->flush_ticket = dd_flush_ticket(dc);
	bio_put(clone);
	if (llist_add(&run->run_node, &dc->stored))
		queue_work(dc->wq, &dc->stored_work);
}

/*
 * One data bio for the blocks of @run, which have consecutive physical
 * blocks. It carries our copies, never the submitter's pages: see
 * dedup-data.h.
 */
static void dd_submit_run(struct dedup_c *dc, struct dd_write_block *run)
{
	struct dd_write *w = run->w;
	struct dd_data_owner owner;
	struct dd_write_block *b;
	struct bio *clone;

	/*
	 * Durability comes from the commit, which flushes the data device.
	 * Only hints are passed on: nobody polls this bio, and it is
	 * submitted from a worker, so REQ_POLLED and REQ_NOWAIT do not apply.
	 * The write is its writer's, as verify's reads are.
	 */
	clone = bio_alloc_bioset(dc->data_dev->bdev, dd_run_len(run),
				 REQ_OP_WRITE | w->hints, GFP_NOIO, &dc->bs);
	dd_write_owner(w, &owner);
	dd_data_own(clone, &owner);
	clone->bi_iter.bi_sector = run->pba * DD_SECTORS_PER_BLOCK;
	for (b = run; b; b = b->run_next)
		__bio_add_page(clone, b->data, DD_BLOCK_SIZE, 0);
	run->error = 0;
	INIT_WORK(&run->work, dd_run_done_work);
	clone->bi_end_io = dd_run_endio;
	clone->bi_private = run;
	submit_bio_noacct(clone);
}

static int dd_run_cmp(const void *a, const void *b)
{
	const struct dd_write_block *x = *(const struct dd_write_block **)a;
	const struct dd_write_block *y = *(const struct dd_write_block **)b;

	return x->pba < y->pba ? -1 : x->pba > y->pba;
}

/*
 * The runs of new data, submitted a batch at a time under one plug and
 * in the order of their physical blocks: the allocator gives the runs of
 * concurrent writes consecutive physical blocks, so the block layer
 * merges them and the data device gets one large write where it would
 * have got many small ones (4 KiB each for random writes). A run's node
 * is read before its bio goes out: on completion it joins dc->stored.
 */
static void dd_write_runs_work(struct work_struct *work)
{
	struct dedup_c *dc = container_of(work, struct dedup_c, write_work);
	struct llist_node *node = llist_del_all(&dc->to_write);
	struct dd_write_block *runs[DD_STORED_RUNS];
	struct blk_plug plug;
	unsigned int nr, i;

	while (node) {
		for (nr = 0; node && nr < DD_STORED_RUNS; nr++) {
			runs[nr] = llist_entry(node, struct dd_write_block,
					       run_node);
			node = node->next;
		}
		sort(runs, nr, sizeof(runs[0]), dd_run_cmp, NULL);
		blk_start_plug(&plug);
		for (i = 0; i < nr; i++)
			dd_submit_run(dc, runs[i]);
		blk_finish_plug(&plug);
	}
}

/*
 * The @nr blocks at @run have consecutive physical blocks: one data bio.
 * When theirs is the only write in flight there is nothing to merge it
 * with, and it goes out at once rather than after one more worker.
 */
static void dd_queue_run(struct dedup_c *dc, struct dd_write_block *run,
			 unsigned int nr)
{
	unsigned int i;

	for (i = 0; i < nr; i++)
		run[i].run_next = i + 1 < nr ? &run[i + 1] : NULL;
	if (atomic_read(&dc->writes_inflight) == 1 &&
	    llist_empty(&dc->to_write)) {
		dd_submit_run(dc, run);
		return;
	}
	if (llist_add(&run->run_node, &dc->to_write))
		queue_work(dc->wq, &dc->write_work);
}

/*
 * What became of each block: finish those done, and queue the data of
 * the new ones for writing, one bio per run of blocks adjacent in the
 * write with consecutive physical blocks. Parked blocks are not touched:
 * they may already be running again elsewhere.
 */
static void dd_act(struct dedup_c *dc, struct dd_write_block *blk, unsigned int nr,
		   const u8 *decision)
{
	unsigned int i, n;

	for (i = 0; i < nr; i += n) {
		n = 1;
		if (decision[i] == DD_DONE) {
			dd_block_done(dc, &blk[i], blk[i].error);
		} else if (decision[i] == DD_STORE) {
			while (i + n < nr && decision[i + n] == DD_STORE &&
			       blk[i + n].pba == blk[i].pba + n)
				n++;
			dd_queue_run(dc, &blk[i], n);
		}
	}
}

/* ------------------------------------------------------------------ */
/* writes acknowledged early */

/*
 * Blocks of writes acknowledged early and not done yet, at most (4 MiB):
 * beyond, a write completes when it is done, and holds its submitter.
 */
#define DD_ACK_MAX_BLOCKS	1024

/*
 * With early_ack, a write is acknowledged before its data is written and
 * mapped, as a disk with a volatile write cache does: before it is
 * decided, once each of its blocks has a data block promised
 * (dd_decide_promise), or else once each is decided (shared, or given a
 * physical block for its data). What keeps that within the guarantees of
 * dm-dedup.rst:
 * - it keeps its cell until it is done, so a later write or discard of
 *   its blocks still comes after it, and a read of them waits for it
 *   (dd_read_behind_write);
 * - a flush waits until every write acknowledged before it is done, and
 *   no write is acknowledged early while a flush waits, so flushes do not
 *   starve; the flush then appends (or commits) as always;
 * - a write that fails once acknowledged (its data write, its share or
 *   its mapping) fails the next flush; its blocks keep their old content;
 *   it never fails for want of space: without a promise, a write that
 *   has no physical block for a block that needs one is not acknowledged;
 * - a FUA write is never acknowledged early, nor, once decided, a write
 *   with a block that failed or waits (behind its twin, or for freed
 *   blocks);
 * - suspend and destruction wait for them all (dd_io_drain).
 */
static bool dd_ack_window_take(struct dedup_c *dc, struct dd_write *w)
{
	bool ok;

	spin_lock(&dc->ack_lock);
	ok = bio_list_empty(&dc->acked_flushes) &&
	     dc->acked_blocks + w->nr <= DD_ACK_MAX_BLOCKS;
	if (ok)
		WRITE_ONCE(dc->acked_blocks, dc->acked_blocks + w->nr);
	spin_unlock(&dc->ack_lock);
	return ok;
}

static void dd_ack_now(struct dedup_c *dc, struct dd_write *w)
{
	struct bio *bio = w->bio;

	w->css = bio_blkcg_css(bio);
	if (w->css)
		css_get(w->css);
	w->bio = NULL;
	atomic64_inc(&dc->early_acks);
	bio_endio(bio);
}

/*
 * Before the write is decided: every block that may store is promised.
 * Its place in the window first, so that no promise is taken only to be
 * given back while a flush waits or the window is full.
 */
static bool dd_ack_undecided(struct dedup_c *dc, struct dd_write *w)
{
	if (!dd_ack_window_take(dc, w))
		return false;
	if (!dd_decide_promise(dc, w->blk, w->nr)) {
		dd_acked_done(dc, w->nr, 0);
		return false;
	}
	atomic64_inc(&dc->early_acks_undecided);
	dd_ack_now(dc, w);
	return true;
}

/* Once decided, without a promise. */
static void dd_ack_decided(struct dedup_c *dc, struct dd_write *w,
			   const u8 *decision)
{
	unsigned int i;

	for (i = 0; i < w->nr; i++)
		if (decision[i] == DD_PARKED ||
		    (decision[i] == DD_DONE && w->blk[i].error))
			return;
	if (dd_ack_window_take(dc, w))
		dd_ack_now(dc, w);
}

/* Flushes that waited for acknowledged writes go on, or fail with @r. */
static void dd_release_flushes(struct dedup_c *dc, struct bio_list *flushes,
			       int r)
{
	struct bio *bio;

	while ((bio = bio_list_pop(flushes))) {
		if (r)
			dd_endio(bio, BLK_STS_IOERR);
		else
			dd_flush_request(dc, bio);
	}
}

/* The @nr blocks of a write acknowledged early are done, with @r. */
static void dd_acked_done(struct dedup_c *dc, unsigned int nr, int r)
{
	struct bio_list flushes;
	int first = 0;
	bool none;

	if (r)
		DMERR_LIMIT("%s: write acknowledged early failed: %d; the next flush fails",
			    dd_name(dc), r);
	bio_list_init(&flushes);
	spin_lock(&dc->ack_lock);
	if (r && !dc->acked_error)
		dc->acked_error = r;
	WRITE_ONCE(dc->acked_blocks, dc->acked_blocks - nr);
	none = !dc->acked_blocks;
	if (none) {
		bio_list_merge(&flushes, &dc->acked_flushes);
		bio_list_init(&dc->acked_flushes);
		if (!bio_list_empty(&flushes)) {
			first = dc->acked_error;
			dc->acked_error = 0;
		}
	}
	spin_unlock(&dc->ack_lock);
	if (none)
		wake_up_all(&dc->acked_wait);
	dd_release_flushes(dc, &flushes, first);
}

/*
 * A flush covers the writes acknowledged before it: it waits for those
 * acknowledged early, and fails if one of them failed since the last
 * flush.
 */
static void dd_flush_after_acked(struct dedup_c *dc, struct bio *bio)
{
	struct bio_list flushes;
	int first;

	bio_list_init(&flushes);
	spin_lock(&dc->ack_lock);
	if (dc->acked_blocks) {
		bio_list_add(&dc->acked_flushes, bio);
		spin_unlock(&dc->ack_lock);
		return;
	}
	first = dc->acked_error;
	dc->acked_error = 0;
	spin_unlock(&dc->ack_lock);
	bio_list_add(&flushes, bio);
	dd_release_flushes(dc, &flushes, first);
}

/*
 * Every write acknowledged early is done. For suspend: dm core waits for
 * the bios it mapped, and these are no longer in flight for it.
 */
void dd_io_drain(struct dedup_c *dc)
{
	wait_event(dc->acked_wait, !READ_ONCE(dc->acked_blocks));
}

static void dd_retry_work(struct work_struct *work);

/*
 * With early_ack, a write is acknowledged before it is decided if it can
 * be; if it is not, whether to try once it is decided.
 */
static bool dd_ack_before_decision(struct dedup_c *dc, struct dd_write *w)
{
	/* A FUA write is durable when it completes: never early. */
	if (!dc->early_ack || w->error || (w->bio->bi_opf & REQ_FUA))
		return false;
	return !dd_ack_undecided(dc, w);
}

/*
 * Decide @nr blocks of one write and act on it: all its blocks at first,
 * then one at a time if any is parked; acknowledged once decided if
 * @ack_decided (early_ack).
 * The caller holds a reference on the write's blocks, put here, so that
 * blocks finishing on other CPUs meanwhile cannot free them under us.
 */
static void dd_decide_and_act(struct dedup_c *dc, struct dd_write_block *blk,
			      unsigned int nr, bool ack_decided)
{
	u8 decision[DD_BIO_BLOCKS];
	struct dd_write *w = blk->w;
	unsigned int i;

	/* A parked block's work decides it again (dedup-decide.c). */
	for (i = 0; i < nr; i++)
		INIT_WORK(&blk[i].work, dd_retry_work);
	dd_decide_write(dc, blk, nr, decision);
	/* Before the data bios go out, which may complete the write. */
	if (ack_decided)
		dd_ack_decided(dc, w, decision);
	dd_act(dc, blk, nr, decision);
	dd_write_put(w);
}

/* A parked block runs again: its twin was stored, or blocks were freed. */
static void dd_retry_work(struct work_struct *work)
{
	struct dd_write_block *b = container_of(work, struct dd_write_block, work);

	atomic_inc(&b->w->pending);
	dd_decide_and_act(b->w->dc, b, 1, false);
}

/* Zero test or fingerprint, on our copy. */
static int dd_hash_block(struct dedup_c *dc, struct dd_write_block *b)
{
	void *p;
	int r;

	if (dd_data_is_zero(b->data)) {
		b->flags |= DD_BLOCK_ZERO;
		return 0;
	}
	p = kmap_local_page(b->data);
	r = dd_fingerprint_block(&dc->hasher, p, b->fp);
	kunmap_local(p);
	return r;
}

/* A failed hash fails the block's write. */
static void dd_hash_into(struct dedup_c *dc, struct dd_write_block *b)
{
	int r = dd_hash_block(dc, b);

	if (r) {
		DMERR_LIMIT("%s: hashing failed: %d", dd_name(dc), r);
		cmpxchg(&b->w->error, 0, r);
	}
}

/*
 * The write is hashed and its turn has come: decide it, or fail it. Its
 * early acknowledgment was tried (w->ack_decided).
 */
static void dd_write_decide(struct dd_write *w)
{
	struct dedup_c *dc = w->dc;
	unsigned int i;

	if (!READ_ONCE(w->error)) {
		dd_decide_and_act(dc, w->blk, w->nr, w->ack_decided);
		return;
	}
	for (i = 0; i < w->nr; i++)
		dd_block_done(dc, &w->blk[i], 0);
	dd_write_put(w);
}

/* Its turn has come: acknowledged early if it can be, then decided. */
static void dd_write_ack_and_decide(struct dd_write *w)
{
	w->ack_decided = dd_ack_before_decision(w->dc, w);
	dd_write_decide(w);
}

static void dd_write_turn_work(struct work_struct *work)
{
	dd_write_ack_and_decide(container_of(work, struct dd_write, work));
}

/* An earlier change to the same blocks left: see dedup-cell.h. */
static void dd_write_turn_ready(struct dd_cell *cell)
{
	struct dd_write *w = container_of(cell, struct dd_write, cell);

	queue_work(w->dc->wq, &w->work);
}

static void dd_discard_turn_ready(struct dd_cell *cell)
{
	struct dd_io *io = container_of(cell, struct dd_io, cell);

	queue_work(io->dc->wq, &io->work);
}

/*
 * A chunk of the write's blocks is hashed without any lock; the last chunk
 * to finish decides the whole write, if no earlier write or discard to
 * the same blocks is still in flight.
 */
static void dd_hash_work(struct work_struct *work)
{
	struct dd_write_block *b = container_of(work, struct dd_write_block, work);
	struct dd_write *w = b->w;
	struct dedup_c *dc = w->dc;
	unsigned int i = b - w->blk, end = min(w->nr, i + DD_HASH_CHUNK);

	for (; i < end; i++)
		dd_hash_into(dc, &w->blk[i]);
	if (atomic_dec_and_test(&w->hashing) &&
	    dd_cell_arm(&dc->cells, &w->cell))
		dd_write_ack_and_decide(w);
}

/*
 * With early_ack, one-block writes are hashed and decided a batch at a
 * time: a hash worker takes every one waiting, so that a random 4 KiB
 * writer at queue depth 32 wakes a worker for a batch, not for each
 * write, and the batch acknowledges all it can early before its first
 * decision, which may wait for a commit. A new batch goes to an idle
 * hash worker (dd_hash_batch_add), so that batches are hashed on several
 * CPUs when one worker cannot keep up, and while one worker waits in a
 * decision the next batch is still acknowledged, if the workqueue has a
 * slot free for it (one per CPU, see dedup_ctr). Without early_ack a
 * write completes only once decided, and its own work item lets it be
 * decided beside the others: batches measured 5 % slower there
 * (Documentation/benchmarks.rst).
 */
static void dd_hash_batch_work(struct work_struct *work)
{
	struct dd_hash_worker *hw = container_of(work, struct dd_hash_worker, work);
	struct dedup_c *dc = hw->dc;
	struct llist_node *node = llist_reverse_order(llist_del_all(&dc->to_hash));
	struct dd_write *w, *next;
	LIST_HEAD(ready);

	llist_for_each_entry_safe(w, next, node, hash_node) {
		dd_hash_into(dc, &w->blk[0]);
		if (dd_cell_arm(&dc->cells, &w->cell)) {
			w->ack_decided = dd_ack_before_decision(dc, w);
			list_add_tail(&w->ready, &ready);
		}
	}
	list_for_each_entry_safe(w, next, &ready, ready)
		dd_write_decide(w);
	clear_bit(hw - dc->hash_work, &dc->hash_busy);
}

/*
 * The first write of a new batch wakes a hash worker that is idle, so
 * that its batch is not acknowledged only once another batch is decided;
 * with all of them busy, the first takes it next.
 */
static void dd_hash_batch_add(struct dedup_c *dc, struct dd_write *w)
{
	unsigned int i;

	if (!llist_add(&w->hash_node, &dc->to_hash))
		return;
	for (i = 0; i < DD_HASH_WORKERS - 1; i++)
		if (!test_and_set_bit(i, &dc->hash_busy))
			break;
	queue_work(dc->wq, &dc->hash_work[i].work);
}

/*
 * A write is copied block by block into pages we own, here in the
 * submitter's context: a writer that finds no page free waits here, and
 * a dedup-io worker never waits for one while completions queue behind
 * it. Hashing and the decision run on the workqueue.
 */
static void dd_write_start(struct dedup_c *dc, struct bio *bio, u64 lba)
{
	struct dd_write *w = mempool_alloc(&dc->write_pool, GFP_NOIO);
	unsigned int nr = bio_sectors(bio) / DD_SECTORS_PER_BLOCK, i;
	struct page **pages;
	struct dd_write_block *b;

	/*
	 * dm core hands the target its clone without a cgroup: only a bio
	 * it submits for the target (dm_submit_bio_remap) gets the original
	 * bio's. Give the clone the cgroup of the task submitting it, here
	 * in its context, so that the data writes and verify reads our
	 * workers make for it are counted as that writer's.
	 */
	bio_associate_blkg(bio);
	w->dc = dc;
	w->bio = bio;
	w->hints = bio->bi_opf & DD_DATA_HINTS;
	w->ioprio = bio->bi_ioprio;
	w->css = NULL;
	w->nr = nr;
	w->error = 0;
	atomic64_set(&w->append, 0);
	w->fua = bio->bi_opf & REQ_FUA;
	w->pooled = false;
	if (nr == 1) {
		w->blk = &w->one;
		pages = &w->one_page;
	} else {
		/* A batch's page pointers follow its blocks. */
		w->blk = kmalloc(nr * DD_BATCH_BYTES,
				 GFP_NOIO | __GFP_NORETRY | __GFP_NOWARN);
		if (!w->blk) {
			w->blk = mempool_alloc(&dc->batch_pool, GFP_NOIO);
			w->pooled = true;
		}
		pages = (struct page **)(w->blk + nr);
	}
	dd_data_copy(&dc->data_pool, bio, pages, nr);
	atomic_inc(&dc->writes_inflight);
	INIT_WORK(&w->work, dd_write_turn_work);
	dd_cell_enter(&dc->cells, &w->cell, lba, lba + nr, dd_write_turn_ready);
	/* One more than the blocks: the decision's, see dd_decide_and_act. */
	atomic_set(&w->pending, nr + 1);
	atomic_set(&w->hashing, DIV_ROUND_UP(nr, DD_HASH_CHUNK));
	for (i = 0; i < nr; i++) {
		b = &w->blk[i];
		b->w = w;
		b->lba = lba + i;
		b->data = pages[i];
		b->flags = 0;
		b->error = 0;
		b->twin = 0;
		INIT_LIST_HEAD(&b->wait_entry);
	}
	if (nr == 1 && dc->early_ack) {
		dd_hash_batch_add(dc, w);
		return;
	}
	for (i = 0; i < nr; i += DD_HASH_CHUNK) {
		INIT_WORK(&w->blk[i].work, dd_hash_work);
		queue_work(dc->wq, &w->blk[i].work);
	}
}

/* ------------------------------------------------------------------ */
/* discard and write zeroes */

static void dd_discard_work(struct work_struct *w)
{
	struct dd_io *io = container_of(w, struct dd_io, work);
	struct dedup_c *dc = io->dc;
	struct bio *bio = dd_bio(io);
	u64 n = bio_sectors(bio) / DD_SECTORS_PER_BLOCK;
	u64 append = 0;
	int r = dd_decide_unmap(dc, io->lba, io->lba + n, &append);

	dd_cell_leave(&dc->cells, &io->cell);
	dd_complete_change(dc, bio, r, append);
}

/* ------------------------------------------------------------------ */
/* entry points */

void dd_io_init(struct dedup_c *dc)
{
	unsigned int i;

	spin_lock_init(&dc->ack_lock);
	bio_list_init(&dc->acked_flushes);
	init_waitqueue_head(&dc->acked_wait);
	dd_cells_init(&dc->cells);
	atomic_set(&dc->writes_inflight, 0);
	init_llist_head(&dc->to_hash);
	dc->hash_busy = 0;
	for (i = 0; i < DD_HASH_WORKERS; i++) {
		dc->hash_work[i].dc = dc;
		INIT_WORK(&dc->hash_work[i].work, dd_hash_batch_work);
	}
	init_llist_head(&dc->to_write);
	INIT_WORK(&dc->write_work, dd_write_runs_work);
	init_llist_head(&dc->stored);
	INIT_WORK(&dc->stored_work, dd_stored_work);
	init_llist_head(&dc->to_read);
	INIT_WORK(&dc->read_work, dd_read_batch_work);
	dc->read_batch_avg = DD_READ_AVG_START;
}

/*
 * Reads and writes map whole logical blocks. The queue limits (logical
 * block size 4 KiB, max_io_len) make every bio whole aligned blocks, at
 * most DD_BIO_BLOCKS; a bio queued under an older table with other
 * limits, or from a misbehaving submitter, is refused rather than half
 * mapped.
 */
static bool dd_bio_is_whole_blocks(struct dedup_c *dc, struct bio *bio)
{
	unsigned int sectors = bio_sectors(bio);

	if (likely(sectors && !(sectors & (DD_SECTORS_PER_BLOCK - 1)) &&
		   sectors <= DD_BIO_BLOCKS * DD_SECTORS_PER_BLOCK &&
		   !(bio->bi_iter.bi_sector & (DD_SECTORS_PER_BLOCK - 1))))
		return true;
	DMERR_LIMIT("%s: refused a %u-byte %s at sector %llu: not whole aligned 4 KiB blocks",
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

	if (bio->bi_opf & REQ_PREFLUSH) {
		/* dm core hands us flushes without data. */
		dd_flush_after_acked(dc, bio);
		return DM_MAPIO_SUBMITTED;
	}

	io->lba = dm_target_offset(dc->ti, bio->bi_iter.bi_sector) /
		  DD_SECTORS_PER_BLOCK;
	switch (bio_op(bio)) {
	case REQ_OP_READ:
		if (!dd_bio_is_whole_blocks(dc, bio))
			return DM_MAPIO_KILL;
		return dd_map_read(dc, io);
	case REQ_OP_WRITE:
		if (!dd_bio_is_whole_blocks(dc, bio))
			return DM_MAPIO_KILL;
		dd_write_start(dc, bio, io->lba);
		return DM_MAPIO_SUBMITTED;
	case REQ_OP_DISCARD:
	case REQ_OP_WRITE_ZEROES:
		/* Whole blocks by the queue limits; less would be nothing. */
		if (bio_sectors(bio) < DD_SECTORS_PER_BLOCK) {
			bio_endio(bio);
			return DM_MAPIO_SUBMITTED;
		}
		INIT_WORK(&io->work, dd_discard_work);
		dd_cell_enter(&dc->cells, &io->cell, io->lba,
			      io->lba + bio_sectors(bio) / DD_SECTORS_PER_BLOCK,
			      dd_discard_turn_ready);
		if (dd_cell_arm(&dc->cells, &io->cell))
			queue_work(dc->wq, &io->work);
		return DM_MAPIO_SUBMITTED;
	default:
		return DM_MAPIO_KILL;
	}
}

void dd_io_end(struct dedup_c *dc, struct bio *bio)
{
	dd_read_untrack(dc, dm_per_bio_data(bio, sizeof(struct dd_io)));
}
