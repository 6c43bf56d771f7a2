// SPDX-License-Identifier: GPL-2.0-only
/*
 * The dedup decision: for a hashed block, share a live block with the same
 * content or store a new one, and every metadata change a bio makes. Owns
 * the fingerprint index and the table of unique writes in flight, both
 * under dc->lock held exclusive (dedup-target.h).
 */
#define DM_MSG_PREFIX "dedup"

#include <linux/blkdev.h>
#include <linux/unaligned.h>

#include "dedup-target.h"

/* Verification retries when a commit overtook the compare. */
#define DD_VERIFY_ATTEMPTS		4
/*
 * Candidates compared byte for byte before storing a copy: with a short
 * hash, somebody may have planted a colliding block in front of the real
 * duplicate.
 */
#define DD_VERIFY_CANDIDATES		8

void dd_decide_init(struct dedup_c *dc)
{
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

/* Only content on disk may be shared: called once its write completed. */
static void dd_index_add(struct dedup_c *dc, const u8 *fp, u64 pba)
{
	lockdep_assert_held_write(&dc->lock);
	if (dd_index_insert(&dc->index, fp, pba))
		atomic64_inc(&dc->index_full);
}

static void dd_index_forget(struct dedup_c *dc, const struct dd_md_freed *f,
			    unsigned int nr)
{
	lockdep_assert_held_write(&dc->lock);
	while (nr--)
		dd_index_remove(&dc->index, f[nr].fp, f[nr].pba);
}

/* A change's result: 1 means it freed a block, which leaves the index. */
static int dd_changed(struct dedup_c *dc, int r, const struct dd_md_freed *f)
{
	if (r == 1)
		dd_index_forget(dc, f, 1);
	return r < 0 ? r : 0;
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

	lockdep_assert_held_write(&dc->lock);
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

/* ------------------------------------------------------------------ */
/* unique writes in flight */

static u32 dd_inflight_key(const u8 *fp)
{
	return get_unaligned_le32(fp);
}

static struct dd_io *dd_inflight_find(struct dedup_c *dc, const u8 *fp)
{
	struct dd_io *io;

	lockdep_assert_held_write(&dc->lock);
	hash_for_each_possible(dc->inflight, io, inflight_node,
			       dd_inflight_key(fp))
		if (!memcmp(io->fp, fp, DD_FP_SIZE))
			return io;
	return NULL;
}

static void dd_inflight_add(struct dedup_c *dc, struct dd_io *io)
{
	lockdep_assert_held_write(&dc->lock);
	INIT_LIST_HEAD(&io->waiters);
	hash_add(dc->inflight, &io->inflight_node, dd_inflight_key(io->fp));
}

/* Writers of the same content decide again, now against the index. */
static void dd_inflight_del(struct dedup_c *dc, struct dd_io *io)
{
	struct dd_io *waiter, *tmp;

	lockdep_assert_held_write(&dc->lock);
	hash_del(&io->inflight_node);
	/* Their work is the write's own (dedup-io.c): it decides again. */
	list_for_each_entry_safe(waiter, tmp, &io->waiters, wait_entry) {
		list_del_init(&waiter->wait_entry);
		queue_work(dc->wq, &waiter->work);
	}
}

/* ------------------------------------------------------------------ */
/* the decision */

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

/* Try to share an existing block. 1: shared, 0: store it, < 0: error. */
static int dd_try_dedup(struct dedup_c *dc, struct dd_io *io)
{
	unsigned int attempts = 0, nr_differ = 0;
	u64 differ[DD_VERIFY_CANDIDATES];
	struct dd_md_freed freed;
	u64 pba, seq;
	int r;

	lockdep_assert_held_write(&dc->lock);
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
		if (dc->commit_seq != seq) {
			if (++attempts < DD_VERIFY_ATTEMPTS)
				goto again;
			return 0;
		}
	}
	r = dd_md_map_duplicate(dc->md, io->lba, pba, &freed);
	if (r == -EOVERFLOW)
		return 0;	/* refcount saturated: store another copy */
	if (r == -ENOENT) {
		if (dc->verify) {
			/* It died while the lock was dropped for the compare. */
			if (++attempts < DD_VERIFY_ATTEMPTS)
				goto again;
			return 0;
		}
		/* The index holds live blocks only. */
		DMERR_LIMIT("physical block %llu: reference taken on a free block",
			    pba);
		return -EILSEQ;
	}
	r = dd_changed(dc, r, &freed);
	return r ? r : 1;
}

/*
 * Under the lock: map a zero block, share a duplicate, or allocate a block
 * for the data and enter the write in the in-flight table.
 */
enum dd_decision dd_decide_write(struct dedup_c *dc, struct dd_io *io, int *rp)
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
		r = dd_changed(dc, r, &freed);
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
		return DD_PARKED;
	}
	r = dd_md_alloc_data(dc->md, &io->pba, &free_left);
	if (r == -EAGAIN) {
		/* Blocks freed by this transaction come back at its commit. */
		dd_wait_for_frees(dc, io);
		up_write(&dc->lock);
		return DD_PARKED;
	}
	if (r) {
		if (r == -ENOSPC)
			atomic64_inc(&dc->nospc_errors);
		goto out;
	}
	dd_inflight_add(dc, io);
	dd_low_water_check(dc, free_left);
	up_write(&dc->lock);
	return DD_STORE;

metadata_done:
	/* A failed change may be half done: nothing more may be committed. */
	if (r && r != -EROFS)
		dd_metadata_error(dc, "write", r);
	else if (!r)
		dd_check_writeback(dc);
out:
	up_write(&dc->lock);
	*rp = r;
	return DD_DONE;
}

/*
 * The data of a DD_STORE write completed (with io->status): map it, and
 * only now let others share it.
 */
int dd_decide_stored(struct dedup_c *dc, struct dd_io *io)
{
	struct dd_md_freed freed;
	int r;

	down_write(&dc->lock);
	if (io->status) {
		dd_md_free_data_now(dc->md, io->pba);
		r = blk_status_to_errno(io->status);
	} else if (READ_ONCE(dc->mode) != DD_MODE_RW) {
		dd_md_free_data_now(dc->md, io->pba);
		r = -EIO;
	} else {
		r = dd_md_map_new(dc->md, io->lba, io->pba, io->fp, &freed);
		r = dd_changed(dc, r, &freed);
		if (r) {
			dd_metadata_error(dc, "mapping a new block", r);
		} else {
			dd_index_add(dc, io->fp, io->pba);
			dd_check_writeback(dc);
		}
	}
	dd_inflight_del(dc, io);
	up_write(&dc->lock);
	return r;
}

/* Discard or write zeroes: unmap [begin, end). */
int dd_decide_unmap(struct dedup_c *dc, u64 begin, u64 end)
{
	unsigned int nr_freed;
	u64 unmapped = 0;
	int r = -EIO;

	down_write(&dc->lock);
	if (READ_ONCE(dc->mode) != DD_MODE_RW)
		goto out;
	do {
		r = dd_md_unmap_range(dc->md, begin, end, dc->freed,
				      ARRAY_SIZE(dc->freed), &nr_freed, &begin,
				      &unmapped);
		/* Blocks freed before an error left the index too. */
		dd_index_forget(dc, dc->freed, nr_freed);
	} while (!r && begin < end);
	if (r)
		dd_metadata_error(dc, "discard", r);
	else
		dd_check_writeback(dc);
out:
	up_write(&dc->lock);
	return r;
}
