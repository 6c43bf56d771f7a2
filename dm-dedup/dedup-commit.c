// SPDX-License-Identifier: GPL-2.0-only
/*
 * Durability and modes: when the running transaction is appended to the
 * journal or committed, who waits for it (flushes, FUA writes, writes
 * waiting for freed blocks), and what happens when metadata I/O fails.
 * Creates dc->lock; dedup-target.h has its rules.
 *
 * A flush or FUA write needs an append (dd_flush): the changes are taken
 * under dc->lock held exclusive for that alone, and written to the
 * journal with FUA while the data device is flushed and writers go on;
 * replay checks the data of an append whose flush a crash cut short.
 * Commits (checkpoints of the journal) come from the interval, a
 * half-full journal, the commit message, writers that need freed
 * blocks, and suspend.
 *
 * A commit holds dc->lock exclusive only to write the metadata, and most
 * of that was written ahead while writers went on. The data the new
 * state points at must be stable first, but the data device is flushed
 * before the lock is taken, while writers go on: a run of new
 * data whose write completed after that flush began is not mapped until
 * the commit is done (dd_data_covered), so everything the commit writes
 * points at data the flush covered. When writes go idle after a flush
 * request, or a FUA write's data is written, the data device is flushed
 * ahead (dd_flush_ahead), so that the flush request that follows finds
 * its data flush on its way or done; when writes go idle, the append is
 * begun as well (dd_writes_idle). Blocks that become reusable at the
 * commit (those freed in the transaction before it) are discarded
 * (discard_passdown) after the lock is let go, and only then reused.
 */
#define DM_MSG_PREFIX "dedup"

#include <linux/blkdev.h>

#include "dedup-target.h"

const char * const dd_mode_names[] = {
	[DD_MODE_RW] = "rw",
	[DD_MODE_RO] = "ro",
	[DD_MODE_NEEDS_CHECK] = "needs_check",
};

/* ------------------------------------------------------------------ */
/* modes and errors */

void dd_degrade(struct dedup_c *dc, int mode, const char *what, int r)
{
	int old = READ_ONCE(dc->mode);

	/* Writers fail concurrently: the worst mode wins, logged once. */
	do {
		if (old >= mode)
			return;
	} while (!try_cmpxchg(&dc->mode, &old, mode));
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
 * disk, and reads fall back to the last commit.
 */
void dd_metadata_error(struct dedup_c *dc, const char *what, int r)
{
	lockdep_assert_held(&dc->lock);
	dd_degrade(dc, dd_error_mode(r), what, r);
	dd_md_abort(dc->md);
	/* The flag's superblock write waits for the lock we hold. */
	if (READ_ONCE(dc->mode) == DD_MODE_NEEDS_CHECK)
		queue_work(dc->commit_wq, &dc->abort_work);
}

/*
 * A read found the metadata damaged, or a block of the running transaction
 * that lost its write, while holding the lock shared: roll back to the
 * last commit as every other metadata error does, so reads show exactly
 * that commit and nothing of the dead transaction stays dirty.
 */
static void dd_abort_work(struct work_struct *w)
{
	struct dedup_c *dc = container_of(w, struct dedup_c, abort_work);
	int r;

	down_write(&dc->lock);
	if (READ_ONCE(dc->mode) != DD_MODE_NEEDS_CHECK || dd_md_needs_check(dc->md)) {
		dd_md_abort(dc->md);
		up_write(&dc->lock);
		return;
	}
	/*
	 * Damage stays damage after a reload or a reboot: record it, so
	 * that the device is not used read-write again before it is checked.
	 */
	r = dd_md_flag_needs_check(dc->md);
	up_write(&dc->lock);
	if (r < 0)
		DMERR("%s: cannot record needs_check in the superblock (error %d)",
		      dd_name(dc), r);
	else if (r)
		DMERR("%s: needs_check saved in the superblock: read-only until checked",
		      dd_name(dc));
	else
		DMERR("%s: needs_check not saved in the superblock: run dedup check",
		      dd_name(dc));
}

void dd_metadata_error_shared(struct dedup_c *dc, const char *what, int r)
{
	lockdep_assert_held_read(&dc->lock);
	dd_degrade(dc, dd_error_mode(r), what, r);
	queue_work(dc->commit_wq, &dc->abort_work);
}

/*
 * dm-bufio writes metadata in the background when dirty blocks pile up and
 * keeps a failed write's error until it is asked; meanwhile the block is
 * gone from the cache and the location holds older content. Ask after
 * every change, so the device stops within one write, not at the next
 * commit up to commit_interval later.
 */
void dd_check_writeback(struct dedup_c *dc)
{
	int r;

	lockdep_assert_held(&dc->lock);
	r = dd_md_writeback_error(dc->md);
	if (r)
		dd_metadata_error(dc, "background metadata write", r);
}

/*
 * Between two steps of one bio that holds the transaction lock shared: a
 * commit waiting for the lock goes first, rather than waiting for every
 * step of a 64-block write.
 */
void dd_let_commit_in(struct dedup_c *dc)
{
	lockdep_assert_held_read(&dc->lock);
	if (rwsem_is_contended(&dc->lock)) {
		up_read(&dc->lock);
		down_read(&dc->lock);
	}
}

void dd_low_water_check(struct dedup_c *dc, u64 free)
{
	lockdep_assert_held(&dc->lock);
	if (!dc->low_water_mark || free > dc->low_water_mark ||
	    atomic_xchg(&dc->low_water_raised, 1))
		return;
	DMWARN("%s: free data blocks (%llu) reached the low water mark (%llu)",
	       dd_name(dc), free, dc->low_water_mark);
	dm_table_event(dc->ti->table);
}

/* ------------------------------------------------------------------ */
/* reads that may touch a block freed in the running transaction */

void dd_read_track(struct dedup_c *dc, struct dd_io *io)
{
	lockdep_assert_held(&dc->lock);
	io->flags |= DD_IO_READ_TRACKED;
	atomic_inc(&dc->reads_inflight);
}

/* A hint for batching: the count may change as soon as it is read. */
unsigned int dd_reads_in_flight(struct dedup_c *dc)
{
	return atomic_read(&dc->reads_inflight);
}

void dd_read_untrack(struct dedup_c *dc, struct dd_io *io)
{
	if ((io->flags & DD_IO_READ_TRACKED) &&
	    atomic_dec_and_test(&dc->reads_inflight))
		wake_up(&dc->reads_wait);
}

/* ------------------------------------------------------------------ */
/* commits */

/*
 * The append that will carry the changes made in this hold of the
 * transaction lock: the next one taken, which takes every record made
 * so far under the lock held exclusive (dd_join_open). A change made
 * after that take goes with the one after.
 */
u64 dd_change_append(struct dedup_c *dc)
{
	lockdep_assert_held_read(&dc->lock);
	return dc->appends_taken + 1;
}

/*
 * A write or discard whose changes go with append @append completes
 * (before its bio does): a flush request that comes after it may join
 * only that append or a later one (dd_defer).
 */
void dd_change_acked(struct dedup_c *dc, u64 append)
{
	dd_raise(&dc->acked_append, append);
}

static void dd_defer(struct dedup_c *dc, struct bio *bio, bool flush)
{
	spin_lock_irq(&dc->flush_lock);
	/* See dd_writes_idle(). */
	dc->ahead_armed = dc->ahead_idles <= 1;
	dc->append_armed = dc->ahead_armed;
	dc->ahead_idles = 0;
	spin_unlock_irq(&dc->flush_lock);
	spin_lock_irq(&dc->commit_lock);
	/*
	 * Every change acknowledged before this request is in the records
	 * of the append on its way, or of one before it: the request needs
	 * that append and nothing more, and completes with it, rather than
	 * wait for it and then find nothing to append. Not with early_ack,
	 * which acknowledges writes before their change is made.
	 */
	if (flush && !dc->early_ack && dc->join_open &&
	    atomic64_read(&dc->acked_append) <= dc->joined_append) {
		bio_list_add(&dc->joined, bio);
		spin_unlock_irq(&dc->commit_lock);
		atomic64_inc(&dc->appends_joined);
		return;
	}
	bio_list_add(&dc->commit_waiters, bio);
	spin_unlock_irq(&dc->commit_lock);
	queue_work(dc->commit_wq, &dc->commit_work);
}

/* A FUA write, written and mapped. */
void dd_defer_to_commit(struct dedup_c *dc, struct bio *bio)
{
	dd_defer(dc, bio, false);
}

/* A flush request (an empty REQ_PREFLUSH bio). */
void dd_flush_request(struct dedup_c *dc, struct bio *bio)
{
	dd_defer(dc, bio, true);
}

/*
 * The write found the data device full, but freed blocks come back at a
 * commit: its work runs again after the next one, and parks again if
 * they need one more (dedup-space.h).
 */
void dd_wait_for_frees(struct dedup_c *dc, struct dd_write_block *blk)
{
	lockdep_assert_held(&dc->lock);
	spin_lock_irq(&dc->commit_lock);
	list_add_tail(&blk->wait_entry, &dc->nospc_waiters);
	spin_unlock_irq(&dc->commit_lock);
	queue_work(dc->commit_wq, &dc->commit_work);
}

static void dd_discard_passdown(struct dedup_c *dc, u64 begin, u64 end)
{
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

/* Called by dd_md_release_held() for each run of blocks a commit freed. */
static void dd_blocks_reusable(void *ctx, u64 begin, u64 end)
{
	dd_discard_passdown(ctx, begin, end);
}

/*
 * When a run of new data finished its write (called at its completion):
 * a commit whose data flush began after this saw the write complete.
 * The barrier pairs with the one in dd_commit_flush_data(): either that
 * flush sees this write counted, or this write sees that flush begun and
 * waits for it (dd_data_covered).
 */
u64 dd_flush_ticket(struct dedup_c *dc)
{
	atomic64_inc(&dc->data_writes_done);
	/* The write's completion is seen before the flush count is read. */
	smp_mb__after_atomic();
	return READ_ONCE(dc->flush_seq);
}

/* Is every data write counted up to @done stable, by a flush that succeeded? */
static bool dd_data_stable(struct dedup_c *dc, u64 done)
{
	lockdep_assert_held(&dc->flush_lock);
	return dc->data_writes_flushed != U64_MAX &&
	       dc->data_writes_flushed >= done;
}

/*
 * A flush sent when data_writes_done was @done succeeded. A commit's and
 * one sent ahead may complete in either order: the newest count stays.
 */
static void dd_data_flush_succeeded(struct dedup_c *dc, u64 done)
{
	lockdep_assert_held(&dc->flush_lock);
	if (!dd_data_stable(dc, done))
		dc->data_writes_flushed = done;
}

static void dd_flush_ahead_endio(struct bio *bio)
{
	struct dedup_c *dc = bio->bi_private;
	blk_status_t status = bio->bi_status;
	int r = dd_device_error(blk_status_to_errno(status));
	struct dd_io_group *group;
	unsigned long flags;

	bio_uninit(bio);
	spin_lock_irqsave(&dc->flush_lock, flags);
	/*
	 * After a failed flush the count stays where the last success before
	 * it left it: a later success does not bring back what the device may
	 * have dropped.
	 */
	if (r && !dc->ahead_error)
		dc->ahead_error = r;
	else if (!dc->ahead_error)
		dd_data_flush_succeeded(dc, dc->ahead_count);
	group = dc->ahead_group;
	spin_unlock_irqrestore(&dc->flush_lock, flags);
	/*
	 * The append that waits for this flush: with no lock held, since its
	 * end takes commit_lock, and before the append sees the flush done
	 * (ahead_group cleared) and frees its group.
	 */
	if (group)
		dd_io_group_put(group, status);

	spin_lock_irqsave(&dc->flush_lock, flags);
	dc->ahead_group = NULL;
	dc->ahead_inflight = false;
	/* Under the lock: a waiter may free dc once it sees the flush done. */
	wake_up_all(&dc->ahead_wait);
	spin_unlock_irqrestore(&dc->flush_lock, flags);
}

/*
 * Send a data flush ahead of the append that needs it, if data was
 * written since the last flush and none is on its way (and, for an
 * @idle one, a flush request armed it): the append then finds it done
 * or on its way and waits for that instead of sending one and waiting
 * for all of it (dd_data_flush_covers). A failed one fails the next
 * append or commit, whatever flushes succeed after it: a device whose
 * flush failed may have dropped the writes it held, and a later flush
 * does not bring them back.
 */
static void dd_flush_ahead(struct dedup_c *dc, bool idle)
{
	u64 done;

	spin_lock_irq(&dc->flush_lock);
	if (idle && dc->ahead_idles < UINT_MAX)
		dc->ahead_idles++;
	done = atomic64_read(&dc->data_writes_done);
	if ((idle && !dc->ahead_armed) || dc->ahead_inflight ||
	    dd_data_stable(dc, done) || READ_ONCE(dc->mode) != DD_MODE_RW) {
		spin_unlock_irq(&dc->flush_lock);
		return;
	}
	dc->ahead_armed = false;
	dc->ahead_inflight = true;
	dc->ahead_count = done;
	dc->ahead_sent++;
	spin_unlock_irq(&dc->flush_lock);

	/* Ours until its completion: only one is on its way at a time. */
	bio_init(&dc->ahead_bio, dc->data_dev->bdev, NULL, 0,
		 REQ_OP_WRITE | REQ_PREFLUSH | REQ_SYNC);
	dc->ahead_bio.bi_end_io = dd_flush_ahead_endio;
	dc->ahead_bio.bi_private = dc;
	atomic64_inc(&dc->data_flushes_ahead);
	submit_bio_noacct(&dc->ahead_bio);
}

/*
 * A FUA write's data was written: the append it waits for needs the
 * data device flushed, so start that while the write is mapped.
 */
void dd_fua_data_written(struct dedup_c *dc)
{
	dd_flush_ahead(dc, false);
}

/*
 * The last write in flight completed. If the last flush request came
 * right after such a moment (at most one since the request before), the
 * writer probably flushes after each burst of writes, as a database's
 * log or a guest's barriers do, and is about to flush again: flush the
 * data device now, ahead of its request, and begin the append too, so
 * that the journal block is written while the writer is woken and sends
 * the request, which then finds nothing left to append. Once per
 * request at most, so a device written without flushes gets no more
 * flushes or appends than before, and a writer that goes idle several
 * times between its flushes (fio --fsync=4) is not armed, since a flush
 * after its first write would not cover the next ones. (An append ahead
 * gained nothing while an append waited for its data flush; since the
 * two go out together it saves the journal block's write and flush.)
 */
void dd_writes_idle(struct dedup_c *dc)
{
	bool append;

	dd_flush_ahead(dc, true);
	spin_lock_irq(&dc->flush_lock);
	append = dc->append_armed && READ_ONCE(dc->mode) == DD_MODE_RW;
	dc->append_armed = false;
	spin_unlock_irq(&dc->flush_lock);
	if (append) {
		atomic64_inc(&dc->appends_ahead);
		queue_work(dc->commit_wq, &dc->commit_work);
	}
}

/*
 * Did a flush that succeeded cover every data write counted up to @done?
 * One sent ahead and still on its way, sent at @done or later, is waited
 * for: it went out before the flush we would send, and covers as much.
 */
static bool dd_data_flush_covers(struct dedup_c *dc, u64 done)
{
	bool covered;

	lockdep_assert_held(&dc->commit_mutex);
	spin_lock_irq(&dc->flush_lock);
	wait_event_lock_irq(dc->ahead_wait,
			    !dc->ahead_inflight || dc->ahead_count < done,
			    dc->flush_lock);
	covered = dd_data_stable(dc, done);
	spin_unlock_irq(&dc->flush_lock);
	return covered;
}

/*
 * May @run, whose data was written, be mapped in the running transaction?
 * Not while a commit is on its way whose data flush may have begun before
 * the run's write completed: that commit would point at data its flush
 * may not cover. The run then waits for that commit, which queues its
 * work again; a commit is never long.
 */
bool dd_data_covered(struct dedup_c *dc, struct dd_write_block *run)
{
	lockdep_assert_held_read(&dc->lock);
	/* committed_seq changes under the lock held exclusive. */
	if (run->flush_ticket <= dc->committed_seq)
		return true;
	spin_lock_irq(&dc->commit_lock);
	list_add_tail(&run->wait_entry, &dc->flush_waiters);
	spin_unlock_irq(&dc->commit_lock);
	return false;
}

/* Is there anything to commit? -EIO: nothing may be committed. */
static int dd_commit_needed(struct dedup_c *dc, bool *dirty)
{
	int r = 0;

	*dirty = false;
	if (dc->read_only || !dc->md)
		return 0;	/* nothing was ever changed */
	down_read(&dc->lock);
	if (READ_ONCE(dc->mode) != DD_MODE_RW)
		r = -EIO;
	else
		*dirty = dd_md_dirty(dc->md);
	up_read(&dc->lock);
	return r;
}

/*
 * What the new state points at must be stable before the state counts:
 * a flush of the data device, begun with no lock that writers need.
 * Runs whose write completes from here on wait for the state taken next
 * (dd_data_covered).
 *
 * None is sent when no data write completed since the last flush that
 * succeeded was issued: that flush covers every write the new state can
 * point at (a run mapped now counted its write before this flush began,
 * or it waits), so a flush after duplicates, discards or zero writes
 * only costs the data device nothing; nor when a flush sent ahead
 * covers them (dd_flush_ahead): that one is waited for instead.
 */
struct dd_data_flush {
	struct bio bio;
	struct completion done;
	struct dd_io_group *group;	/* of the append that needs it */
	u64 count;		/* data_writes_done when it began */
	bool sent;		/* bio is ours and on its way */
	u64 ahead;		/* 0, or ahead_sent of one on its way then */
};

static void dd_data_flush_endio(struct bio *bio)
{
	struct dd_data_flush *f = container_of(bio, struct dd_data_flush, bio);

	/* Before the waiter is woken: the group lives on its stack. */
	if (f->group)
		dd_io_group_put(f->group, bio->bi_status);
	complete(&f->done);
}

/*
 * @group (or NULL): the append that needs the flush. The flush we send
 * is a part of it, and so is a flush sent ahead that is on its way, even
 * one that does not cover ours: if it fails, so does the append
 * (dd_flush_ahead), and the group must not end before it is known. A
 * commit waits for such a flush too: the device may have processed it
 * first, failed it and dropped what it held, and then completed ours.
 */
static void dd_data_flush_begin(struct dedup_c *dc, struct dd_data_flush *f,
				struct dd_io_group *group)
{
	bool stable, ahead;

	lockdep_assert_held(&dc->commit_mutex);
	WRITE_ONCE(dc->flush_seq, dc->flush_seq + 1);
	/* Counted before the flush is issued: see dd_flush_ticket(). */
	smp_mb();
	f->count = atomic64_read(&dc->data_writes_done);
	f->sent = false;
	f->group = group;
	spin_lock_irq(&dc->flush_lock);
	stable = dd_data_stable(dc, f->count);
	ahead = !stable && dc->ahead_inflight && dc->ahead_count >= f->count;
	f->ahead = dc->ahead_inflight ? dc->ahead_sent : 0;
	/*
	 * dd_data_flush_end() waits until its completion let the group go.
	 * If that completion already looked for a group (a narrow window),
	 * the part is never put and the group never ends: the commit worker
	 * completes the append's requests instead.
	 */
	if (group && dc->ahead_inflight && !dc->ahead_error) {
		dd_io_group_get(group);
		dc->ahead_group = group;
	}
	spin_unlock_irq(&dc->flush_lock);
	if (stable || ahead)
		return;
	if (group)
		dd_io_group_get(group);
	init_completion(&f->done);
	bio_init(&f->bio, dc->data_dev->bdev, NULL, 0,
		 REQ_OP_WRITE | REQ_PREFLUSH | REQ_SYNC);
	f->bio.bi_end_io = dd_data_flush_endio;
	submit_bio(&f->bio);
	f->sent = true;
}

/*
 * Did a flush sent ahead fail? Then data written before it may be lost.
 * Also asked from a completion (dd_append_durable).
 */
static int dd_data_flush_ahead_error(struct dedup_c *dc)
{
	unsigned long flags;
	int r;

	spin_lock_irqsave(&dc->flush_lock, flags);
	r = dc->ahead_error;
	spin_unlock_irqrestore(&dc->flush_lock, flags);
	return r;
}

/* The flush begun is done: 0 if the data it covers is stable. */
static int dd_data_flush_end(struct dedup_c *dc, struct dd_data_flush *f)
{
	int r;

	lockdep_assert_held(&dc->commit_mutex);
	if (f->ahead) {
		/*
		 * Its error is ours, and its completion may still put our
		 * group: see dd_flush_ahead_endio.
		 */
		spin_lock_irq(&dc->flush_lock);
		wait_event_lock_irq(dc->ahead_wait,
				    !dc->ahead_inflight ||
				    dc->ahead_sent != f->ahead,
				    dc->flush_lock);
		spin_unlock_irq(&dc->flush_lock);
	}
	if (!f->sent && dd_data_flush_covers(dc, f->count)) {
		WRITE_ONCE(dc->data_flushes_skipped,
			   dc->data_flushes_skipped + 1);
		/* Covered before a flush ahead failed: still the next append fails. */
		return dd_data_flush_ahead_error(dc);
	}
	if (f->sent) {
		wait_for_completion_io(&f->done);
		r = dd_device_error(blk_status_to_errno(f->bio.bi_status));
		bio_uninit(&f->bio);
	} else {
		/* It was to cover ours: it failed, or dd_data_flush_covers waited. */
		r = dd_data_flush_ahead_error(dc);
		if (!r)
			r = dd_device_error(blkdev_issue_flush(dc->data_dev->bdev));
	}
	if (!r)
		r = dd_data_flush_ahead_error(dc);
	if (!r) {
		spin_lock_irq(&dc->flush_lock);
		dd_data_flush_succeeded(dc, f->count);
		spin_unlock_irq(&dc->flush_lock);
	}
	return r;
}

static int dd_commit_flush_data(struct dedup_c *dc)
{
	struct dd_data_flush f;

	dd_data_flush_begin(dc, &f, NULL);
	return dd_data_flush_end(dc, &f);
}

/* The metadata part, under the transaction lock held exclusive. */
static int dd_commit_metadata(struct dedup_c *dc, int flush_error)
{
	int r;

	lockdep_assert_held_write(&dc->lock);
	if (flush_error) {
		/* The new state may point at data that is not stable. */
		dd_metadata_error(dc, "flushing the data device", flush_error);
		return flush_error;
	}
	if (READ_ONCE(dc->mode) != DD_MODE_RW)
		return -EIO;
	/*
	 * Blocks freed in the last transaction become reusable at this
	 * commit (data frees always cool, dedup-space.h: no other commit
	 * lets a freed block be reused, and held frees are released only
	 * after it); a read that looked one up before it was freed must not
	 * see new content. New lookups are excluded by the lock; a verify
	 * read made without it finds reuse_seq moved (dd_share,
	 * dd_verify_write). Commits that reuse nothing leave it alone, so
	 * that reads made across them still count.
	 */
	if (dd_md_data_reusable_at_commit(dc->md)) {
		dc->reuse_seq++;
		wait_event(dc->reads_wait, !atomic_read(&dc->reads_inflight));
	}
	r = dd_md_commit(dc->md, NULL, NULL);
	if (r)
		dd_metadata_error(dc, "metadata commit", r);
	return r;
}

/*
 * The data flush that began at flush_seq is done: runs that waited for
 * it may be mapped, failed or not (see dd_data_covered). Called with the
 * transaction lock held exclusive; their work runs after it is let go.
 */
static void dd_data_flushed(struct dedup_c *dc, struct list_head *covered)
{
	lockdep_assert_held_write(&dc->lock);
	dc->committed_seq = dc->flush_seq;
	spin_lock_irq(&dc->commit_lock);
	list_splice_init(&dc->flush_waiters, covered);
	spin_unlock_irq(&dc->commit_lock);
}

static void dd_map_covered(struct dedup_c *dc, struct list_head *covered)
{
	struct dd_write_block *run, *tmp;

	/* Their work is the run's data completion (dedup-io.c): it maps them. */
	list_for_each_entry_safe(run, tmp, covered, wait_entry) {
		list_del_init(&run->wait_entry);
		queue_work(dc->wq, &run->work);
	}
}

/*
 * Writing the changed metadata blocks is most of a commit: write them
 * while writers go on, as one more shared step, so that the commit keeps
 * writers out only while it writes what changed since, flushes, and
 * writes the superblock.
 */
static void dd_commit_write_ahead(struct dedup_c *dc)
{
	lockdep_assert_held(&dc->commit_mutex);
	down_read(&dc->lock);
	dd_md_write_ahead(dc->md);
	up_read(&dc->lock);
}

/* A commit holds writers out from here to dd_commit_let_in(). */
static ktime_t dd_commit_hold(struct dedup_c *dc)
{
	lockdep_assert_held(&dc->commit_mutex);
	down_write(&dc->lock);
	return ktime_get();
}

/* ... and counts for how long, for the stats message. */
static void dd_commit_let_in(struct dedup_c *dc, ktime_t held)
{
	u64 ns = ktime_to_ns(ktime_sub(ktime_get(), held));

	up_write(&dc->lock);
	WRITE_ONCE(dc->commit_hold_ns, dc->commit_hold_ns + ns);
	if (ns > dc->commit_hold_max_ns)
		WRITE_ONCE(dc->commit_hold_max_ns, ns);
}

static int dd_commit_locked(struct dedup_c *dc)
{
	LIST_HEAD(covered);
	ktime_t held;
	bool dirty;
	int r;

	lockdep_assert_held(&dc->commit_mutex);
	r = dd_commit_needed(dc, &dirty);
	if (r || !dirty)
		return r;
	dd_commit_write_ahead(dc);
	held = dd_commit_hold(dc);
	if (dd_md_journaled(dc->md) && !dd_md_journal_pending(dc->md)) {
		/*
		 * A checkpoint of appended changes only: each append flushed
		 * the data it points at, so no flush is needed, and none may
		 * fail the device for data it will not write.
		 */
		r = dd_commit_metadata(dc, 0);
		dd_commit_let_in(dc, held);
	} else {
		dd_commit_let_in(dc, held);
		r = dd_commit_flush_data(dc);
		held = dd_commit_hold(dc);
		r = dd_commit_metadata(dc, r);
		dd_data_flushed(dc, &covered);
		dd_commit_let_in(dc, held);
		dd_map_covered(dc, &covered);
	}
	if (dc->discard_passdown)
		dd_md_release_held(dc->md, dd_blocks_reusable, dc);
	if (!r && atomic_read(&dc->low_water_raised) &&
	    dd_md_free_data_blocks(dc->md) > dc->low_water_mark)
		atomic_set(&dc->low_water_raised, 0);
	return r;
}

int dd_commit(struct dedup_c *dc)
{
	int r;

	mutex_lock(&dc->commit_mutex);
	r = dd_commit_locked(dc);
	mutex_unlock(&dc->commit_mutex);
	return r;
}

/*
 * The append's records are taken, under the transaction lock held
 * exclusive: every change made so far is in them, and every change made
 * from now on goes with the next append (dd_change_append). Until this
 * one is done, a flush request that needs no later one joins it.
 */
static void dd_join_open(struct dedup_c *dc)
{
	lockdep_assert_held_write(&dc->lock);
	dc->appends_taken++;
	spin_lock_irq(&dc->commit_lock);
	dc->join_open = true;
	dc->joined_append = dc->appends_taken;
	spin_unlock_irq(&dc->commit_lock);
}

/*
 * The append and the data flushes it waits for are done and succeeded:
 * the flush requests that joined it complete now, from the completion of
 * the last of them, rather than after the commit worker is woken (a hop
 * of 100 to 200 us under TCG). The worker finds them gone
 * (dd_join_close). On any failure they are left to it, which fails them.
 */
struct dd_append {
	struct dd_io_group group;	/* the journal blocks, the data flushes */
	struct dedup_c *dc;
	bool ended;			/* joined requests completed here */
};

static void dd_append_durable(struct dd_io_group *g, bool failed)
{
	struct dd_append *a = container_of(g, struct dd_append, group);
	struct dedup_c *dc = a->dc;
	struct bio_list joined;
	unsigned long flags;
	struct bio *bio;

	/* As dd_data_flush_end(): also an earlier flush sent ahead failed. */
	if (failed || dd_data_flush_ahead_error(dc))
		return;
	/*
	 * An abort (dd_metadata_error: the mode first, then the journal read
	 * back) may have read the journal before this append reached it, and
	 * its reads would not show it: dd_flush fails the requests instead.
	 */
	if (READ_ONCE(dc->mode) != DD_MODE_RW)
		return;
	spin_lock_irqsave(&dc->commit_lock, flags);
	dc->join_open = false;
	joined = dc->joined;
	bio_list_init(&dc->joined);
	spin_unlock_irqrestore(&dc->commit_lock, flags);
	a->ended = !bio_list_empty(&joined);
	while ((bio = bio_list_pop(&joined)))
		dd_endio(bio, BLK_STS_OK);
}

/*
 * The append is durable with its data (@r 0), or failed: so did they.
 * Did any join it (and not complete already, dd_append_durable)?
 */
static bool dd_join_close(struct dedup_c *dc, int r)
{
	struct bio_list joined;
	struct bio *bio;
	bool any;

	lockdep_assert_held(&dc->commit_mutex);
	spin_lock_irq(&dc->commit_lock);
	dc->join_open = false;
	joined = dc->joined;
	bio_list_init(&dc->joined);
	spin_unlock_irq(&dc->commit_lock);
	any = !bio_list_empty(&joined);
	while ((bio = bio_list_pop(&joined)))
		dd_endio(bio, r ? BLK_STS_IOERR : BLK_STS_OK);
	return any;
}

/*
 * What a flush or FUA write needs: the changes made so far durable. With
 * a journal that is one append, written with no lock that writers need;
 * without one, or when the journal cannot take it, a commit.
 *
 * The append and the data flush it needs go out together: the append is
 * marked unflushed, and replay drops it if the data of a block it made
 * live is not there (Documentation/dedup-format.rst, "The newest
 * append"). Only the newest append can be such: the flush request
 * completes, and the next append begins, once both are done.
 */
static int dd_flush(struct dedup_c *dc, bool *joined)
{
	struct dd_journal_batch batch;
	struct dd_data_flush f;
	struct dd_append a = { .dc = dc };
	bool dirty, flushed = false;
	LIST_HEAD(covered);
	int r, fr = 0;

	*joined = false;
	/* One part is the journal blocks; each data flush adds its own. */
	dd_io_group_init(&a.group, 1, dd_append_durable);
	mutex_lock(&dc->commit_mutex);
	r = dd_commit_needed(dc, &dirty);
	if (r || !dirty)
		goto out;
	if (!dd_md_journaled(dc->md)) {
		r = dd_commit_locked(dc);
		goto out;
	}
	/*
	 * Every change made so far was appended, with its data flushed
	 * before: an idle flush sends nothing. A change made from here on
	 * was not acknowledged before this flush arrived.
	 */
	if (!dd_md_journal_pending(dc->md))
		goto out;
	dd_data_flush_begin(dc, &f, &a.group);
	down_write(&dc->lock);
	if (READ_ONCE(dc->mode) != DD_MODE_RW)
		r = -EIO;
	else
		r = dd_md_journal_take(dc->md, &batch);
	/* Runs this flush may not cover go to the next batch. */
	dd_data_flushed(dc, &covered);
	if (!r)
		dd_join_open(dc);
	up_write(&dc->lock);
	dd_map_covered(dc, &covered);

	if (!r && !batch.unflushed) {
		/* The superblock does not allow it yet: the data first. */
		fr = dd_data_flush_end(dc, &f);
		flushed = true;
		if (fr)
			dd_md_journal_drop(dc->md, &batch);
	}
	if (!r && !fr) {
		batch.notify = &a.group;
		r = dd_md_journal_write(dc->md, &batch);
		if (r) {
			down_write(&dc->lock);
			dd_metadata_error(dc, "journal append", r);
			up_write(&dc->lock);
		}
	}
	if (!flushed)
		fr = dd_data_flush_end(dc, &f);
	if (!r && !fr)
		dd_md_journal_data_stable(dc->md);
	if (fr) {
		/* Records may point at data that is not stable. */
		down_write(&dc->lock);
		dd_metadata_error(dc, "flushing the data device", fr);
		up_write(&dc->lock);
		r = fr;
	} else if (r == -ENODATA) {
		r = 0;
	} else if (r == -ENOSPC) {
		r = dd_commit_locked(dc);
	}
	/* Durable, but an abort's reads may not show it: dd_append_durable(). */
	if (!r && READ_ONCE(dc->mode) != DD_MODE_RW)
		r = -EIO;
	*joined = dd_join_close(dc, r) || a.ended;
out:
	mutex_unlock(&dc->commit_mutex);
	return r;
}

/*
 * Does data block @pba hold the data whose fingerprint @fp the journal's
 * newest append recorded? Asked when that append was written while its
 * data was being flushed and is replayed: at activation, and in memory
 * after an abort.
 */
int dd_journal_data_verify(void *ctx, u64 pba, const u8 *fp)
{
	struct dedup_c *dc = ctx;
	u8 found[DD_FP_SIZE];
	struct page *page;
	int r;

	/* Also after an abort, under the metadata lock that writeback needs. */
	page = alloc_page(GFP_NOIO);
	if (!page)
		return -ENOMEM;
	r = dd_data_read_block(dc->data_dev->bdev, pba, page, NULL);
	if (!r)
		r = dd_fingerprint_block(&dc->hasher, page_address(page), found);
	__free_page(page);
	if (r)
		return r;
	return memcmp(found, fp, DD_FP_SIZE) ? 1 : 0;
}

/*
 * Before activation checks the newest append's data and checkpoints what
 * it found. The check reads what the device returns, which may still sit
 * in its volatile cache after a crash that did not cut its power; the
 * checkpoint makes the append permanent, so the data must be as well.
 */
int dd_journal_data_flush(void *ctx)
{
	struct dedup_c *dc = ctx;
	int r = blkdev_issue_flush(dc->data_dev->bdev);

	if (r)
		DMERR("%s: journal: cannot flush the data device to check the newest append: %d",
		      dd_name(dc), r);
	return dd_device_error(r);
}

/*
 * The commit message: a commit, and one more if that one released data
 * blocks, so that they are free when the message returns (dedup-space.h).
 */
int dd_commit_settled(struct dedup_c *dc)
{
	int r = dd_commit(dc);

	if (!r && dc->md && !dc->read_only &&
	    dd_md_data_reusable_at_commit(dc->md))
		r = dd_commit(dc);
	return r;
}

static void dd_commit_work(struct work_struct *w)
{
	struct dedup_c *dc = container_of(w, struct dedup_c, commit_work);
	struct dd_write_block *blk, *tmp;
	struct bio_list bios;
	struct bio *bio;
	LIST_HEAD(retry);
	bool checkpoint, waiters, joined = false;
	int r;

	spin_lock_irq(&dc->commit_lock);
	bios = dc->commit_waiters;
	waiters = !bio_list_empty(&bios);
	bio_list_init(&dc->commit_waiters);
	list_splice_init(&dc->nospc_waiters, &retry);
	spin_unlock_irq(&dc->commit_lock);

	/* Freed blocks come back at commits only; so does a due interval. */
	checkpoint = !list_empty(&retry) ||
		     atomic_xchg(&dc->checkpoint_wanted, 0);
	r = checkpoint ? dd_commit(dc) : dd_flush(dc, &joined);

	while ((bio = bio_list_pop(&bios)))
		dd_endio(bio, r ? BLK_STS_IOERR : BLK_STS_OK);
	/*
	 * Half the journal is used: empty it while no flush waits for it.
	 * After an append ahead that no request joined (no waiters), the
	 * flush request it was made for is probably on its way: it does
	 * that, rather than wait for it.
	 */
	if (!r && !checkpoint && (waiters || joined) && dc->md &&
	    dd_md_checkpoint_due(dc->md))
		r = dd_commit(dc);
	/* Their work is the block's own (dedup-io.c): it decides again. */
	list_for_each_entry_safe(blk, tmp, &retry, wait_entry) {
		list_del_init(&blk->wait_entry);
		queue_work(dc->wq, &blk->work);
	}
}

static void dd_periodic_commit(struct work_struct *w)
{
	struct dedup_c *dc = container_of(to_delayed_work(w), struct dedup_c,
					  periodic_commit);

	atomic_set(&dc->checkpoint_wanted, 1);
	queue_work(dc->commit_wq, &dc->commit_work);
	queue_delayed_work(dc->commit_wq, &dc->periodic_commit,
			   dc->commit_interval * HZ);
}

void dd_commit_init(struct dedup_c *dc)
{
	mutex_init(&dc->commit_mutex);
	dc->flush_seq = 0;
	dc->committed_seq = 0;
	dc->reuse_seq = 0;
	dc->data_flushes_skipped = 0;
	dc->commit_hold_ns = 0;
	dc->commit_hold_max_ns = 0;
	INIT_LIST_HEAD(&dc->flush_waiters);
	init_rwsem(&dc->lock);
	spin_lock_init(&dc->commit_lock);
	bio_list_init(&dc->commit_waiters);
	INIT_LIST_HEAD(&dc->nospc_waiters);
	dc->join_open = false;
	dc->appends_taken = 0;
	dc->joined_append = 0;
	bio_list_init(&dc->joined);
	atomic64_set(&dc->acked_append, 0);
	atomic64_set(&dc->appends_joined, 0);
	atomic_set(&dc->reads_inflight, 0);
	atomic_set(&dc->low_water_raised, 0);
	atomic_set(&dc->checkpoint_wanted, 0);
	atomic64_set(&dc->data_writes_done, 0);
	spin_lock_init(&dc->flush_lock);
	/* No flush yet covers anything: the first one goes out. */
	dc->data_writes_flushed = U64_MAX;
	dc->ahead_armed = false;
	dc->append_armed = false;
	dc->ahead_idles = 0;
	dc->ahead_inflight = false;
	dc->ahead_sent = 0;
	dc->ahead_group = NULL;
	dc->ahead_error = 0;
	init_waitqueue_head(&dc->ahead_wait);
	atomic64_set(&dc->data_flushes_ahead, 0);
	atomic64_set(&dc->appends_ahead, 0);
	init_waitqueue_head(&dc->reads_wait);
	INIT_WORK(&dc->commit_work, dd_commit_work);
	INIT_DELAYED_WORK(&dc->periodic_commit, dd_periodic_commit);
	INIT_WORK(&dc->abort_work, dd_abort_work);
}

void dd_commit_start(struct dedup_c *dc)
{
	if (!dc->read_only)
		queue_delayed_work(dc->commit_wq, &dc->periodic_commit,
				   dc->commit_interval * HZ);
}

/*
 * Drain: the periodic commit is cancelled, and every bio work and commit
 * queued so far has run, and the flush sent ahead, if any, is done (dm
 * core does not wait for it). The caller commits what is left.
 */
void dd_commit_stop(struct dedup_c *dc)
{
	cancel_delayed_work_sync(&dc->periodic_commit);
	flush_workqueue(dc->wq);
	flush_workqueue(dc->read_wq);
	flush_workqueue(dc->commit_wq);
	spin_lock_irq(&dc->flush_lock);
	wait_event_lock_irq(dc->ahead_wait, !dc->ahead_inflight,
			    dc->flush_lock);
	spin_unlock_irq(&dc->flush_lock);
}
