// SPDX-License-Identifier: GPL-2.0-only
/*
 * Metadata block manager; see dedup-block.h.
 */
#define DM_MSG_PREFIX "dedup"

#include <linux/bio.h>
#include <linux/bitmap.h>
#include <linux/crc32c.h>
#include <linux/device-mapper.h>
#include <linux/dm-bufio.h>
#include <linux/overflow.h>
#include <linux/sched.h>
#include <linux/slab.h>

#include "dedup-block.h"

/*
 * What dm-bufio keeps back for when memory is short: a writer holds a
 * path from root to leaf in two arrays, or the leaves of a run of shares
 * (four per share, dd_share_run). Otherwise dm-bufio allocates, or reuses
 * a clean buffer nobody holds.
 */
#define DD_RESERVED_BUFFERS	32

/* Per-buffer state kept by dm-bufio next to the data. */
struct dd_aux {
	struct dd_bm *bm;	/* set whenever a buffer is handed out */
	bool validated;	/* checksum and location checked since it was read */
};

u32 dd_block_csum(const void *data)
{
	return ~crc32c(~0U, (const u8 *)data + sizeof(__le32),
		       DD_BLOCK_SIZE - sizeof(__le32));
}

bool dd_block_csum_ok(const void *data)
{
	const struct dd_block_header *h = data;

	return le32_to_cpu(h->csum) == dd_block_csum(data);
}

static void dd_alloc_callback(struct dm_buffer *buf)
{
	struct dd_aux *aux = dm_bufio_get_aux_data(buf);

	aux->bm = NULL;
	aux->validated = false;
}

/*
 * A write-out writes its blocks in its own thread, which dm-bufio's
 * write callback can tell from the threads of background writeback. A
 * write-out that finds no free slot goes unregistered: its writes count
 * as background ones, which costs a write-out, never an error.
 */
static void dd_bm_out_begin(struct dd_bm *bm)
{
	unsigned int i;

	spin_lock(&bm->out_lock);
	for (i = 0; i < DD_BM_OUT_TASKS; i++) {
		if (!bm->out_tasks[i]) {
			bm->out_tasks[i] = current;
			break;
		}
	}
	spin_unlock(&bm->out_lock);
}

static void dd_bm_out_end(struct dd_bm *bm)
{
	unsigned int i;

	spin_lock(&bm->out_lock);
	for (i = 0; i < DD_BM_OUT_TASKS; i++) {
		if (bm->out_tasks[i] == current) {
			bm->out_tasks[i] = NULL;
			break;
		}
	}
	spin_unlock(&bm->out_lock);
}

static bool dd_bm_writing_out(struct dd_bm *bm)
{
	bool mine = false;
	unsigned int i;

	spin_lock(&bm->out_lock);
	for (i = 0; i < DD_BM_OUT_TASKS; i++)
		mine |= bm->out_tasks[i] == current;
	spin_unlock(&bm->out_lock);
	return mine;
}

/*
 * Called by dm-bufio right before every write of a block, under its own
 * lock and maybe from its reclaim: no sleeping here. A write that is not
 * part of dd_bm_write_all() or of a write-ahead is background writeback,
 * whose error dm-bufio keeps to itself until the next
 * dm_bufio_write_dirty_buffers(); flag it so that dd_bm_writeback_error()
 * asks soon, not at the next commit. Whether a write-out runs meanwhile
 * does not matter: one that took the errors before this write completes
 * leaves its error for the next.
 */
static void dd_write_callback(struct dm_buffer *buf)
{
	struct dd_block_header *h = dm_bufio_get_block_data(buf);
	struct dd_aux *aux = dm_bufio_get_aux_data(buf);

	h->csum = cpu_to_le32(dd_block_csum(h));
	if (aux->bm && !dd_bm_writing_out(aux->bm))
		set_bit(DD_BM_BACKGROUND_WRITE, &aux->bm->flags);
}

int dd_bm_create(struct block_device *bdev, u64 nr_blocks, struct dd_bm **bmp)
{
	struct dd_bm *bm;
	int r;

	bm = kzalloc(sizeof(*bm), GFP_KERNEL);
	if (!bm)
		return -ENOMEM;
	bm->bufio = dm_bufio_client_create(bdev, DD_BLOCK_SIZE,
					   DD_RESERVED_BUFFERS,
					   sizeof(struct dd_aux),
					   dd_alloc_callback,
					   dd_write_callback, 0);
	if (IS_ERR(bm->bufio)) {
		r = PTR_ERR(bm->bufio);
		kfree(bm);
		return r;
	}
	r = dd_space_init(&bm->space, nr_blocks, DD_FIRST_TREE_BLOCK);
	bm->fresh = kvcalloc(BITS_TO_LONGS(nr_blocks), sizeof(unsigned long),
			     GFP_KERNEL);
	if (r || !bm->fresh) {
		if (!r)
			dd_space_exit(&bm->space);
		kvfree(bm->fresh);
		dm_bufio_client_destroy(bm->bufio);
		kfree(bm);
		return r ? r : -ENOMEM;
	}
	spin_lock_init(&bm->out_lock);
	bm->fresh_lo = U64_MAX;
	bm->nr_blocks = nr_blocks;
	bm->bdev = bdev;
	*bmp = bm;
	return 0;
}

void dd_bm_destroy(struct dd_bm *bm)
{
	dm_bufio_client_destroy(bm->bufio);
	dd_space_exit(&bm->space);
	kvfree(bm->fresh);
	kfree(bm);
}

/*
 * Was block @nr written by the running transaction? No commit references
 * such a block, so it changes in place. Callers hold the metadata lock,
 * shared at least: the bits change under it held exclusive.
 */
bool dd_bm_is_fresh(const struct dd_bm *bm, u64 nr)
{
	return nr < bm->nr_blocks && test_bit(nr, bm->fresh);
}

static void dd_mark_fresh(struct dd_bm *bm, u64 nr)
{
	__set_bit(nr, bm->fresh);
	bm->fresh_lo = min(bm->fresh_lo, nr);
	bm->fresh_hi = max(bm->fresh_hi, nr + 1);
}

/* The next-fit allocator keeps the range short: clear only that. */
static void dd_forget_fresh(struct dd_bm *bm)
{
	if (bm->fresh_lo < bm->fresh_hi)
		bitmap_clear(bm->fresh, bm->fresh_lo,
			     bm->fresh_hi - bm->fresh_lo);
	bm->fresh_lo = U64_MAX;
	bm->fresh_hi = 0;
}

/* The running transaction committed: its blocks are now the committed ones. */
void dd_bm_next_txn(struct dd_bm *bm)
{
	dd_forget_fresh(bm);
	bm->txn++;
}

static void dd_set_block(struct dd_bm *bm, struct dd_block *blk,
			 struct dm_buffer *buf, void *data, u64 nr)
{
	struct dd_aux *aux = dm_bufio_get_aux_data(buf);

	aux->bm = bm;
	blk->buf = buf;
	blk->data = data;
	blk->nr = nr;
}

/*
 * A block the running transaction wrote carries its id; any other block
 * must be older. A fresh block that reads back an older id lost its write:
 * dm-bufio drops a buffer whose background write failed, and the next
 * read returns what the location held before, checksum and location
 * intact. Serving that would remap reads through stale entries.
 */
static int dd_check_txn(const struct dd_bm *bm, const struct dd_block *blk)
{
	u64 txn = le64_to_cpu(dd_hdr(blk)->txn);

	if (dd_bm_is_fresh(bm, blk->nr)) {
		if (txn == bm->txn)
			return 0;
		DMERR_LIMIT("%s: metadata block %llu: write lost (transaction %llu, reads %llu)",
			    dd_bm_name(bm), blk->nr, bm->txn, txn);
		return -ESTALE;
	}
	if (txn < bm->txn)
		return 0;
	DMERR_LIMIT("%s: metadata block %llu: transaction %llu, not older than %llu",
		    dd_bm_name(bm), blk->nr, txn, bm->txn);
	return -EILSEQ;
}

/*
 * A block that fails its checksum or location test is damage, unless the
 * running transaction wrote it: then the location holds whatever it held
 * before the lost write (zeros on a new device, a torn write), and the
 * committed state is whole. That is a lost write, as in dd_check_txn(),
 * and must not flag the device for a check.
 */
static int dd_bad_block(const struct dd_bm *bm, const struct dd_block *blk)
{
	return dd_bm_is_fresh(bm, blk->nr) ? -ESTALE : -EILSEQ;
}

static const char *dd_bad_block_text(int r)
{
	return r == -ESTALE ? " (write lost)" : "";
}

static int dd_validate(const struct dd_bm *bm, struct dd_block *blk,
		       const struct dd_block_kind *kind)
{
	struct dd_aux *aux = dm_bufio_get_aux_data(blk->buf);
	const struct dd_block_header *h = blk->data;
	int r;

	/*
	 * Holders of a block just read check it side by side; the first to
	 * finish may change it in place (a fresh leaf) while another still
	 * sums it, and dm-bufio's writeback may rewrite its checksum. A
	 * mismatch found after another holder passed the check is that
	 * change, not damage. The acquire pairs with the release below: a
	 * holder that sees the flag set sees the block as it was checked, or
	 * changed since.
	 */
	if (!smp_load_acquire(&aux->validated)) {
		if (!dd_block_csum_ok(h)) {
			/* The sum's loads before the flag's second load. */
			smp_rmb();
			if (!READ_ONCE(aux->validated)) {
				r = dd_bad_block(bm, blk);
				DMERR_LIMIT("%s: metadata block %llu: checksum mismatch%s",
					    dd_bm_name(bm), blk->nr,
					    dd_bad_block_text(r));
				return r;
			}
		}
		if (le64_to_cpu(h->blocknr) != blk->nr) {
			r = dd_bad_block(bm, blk);
			DMERR_LIMIT("%s: metadata block %llu: claims to be block %llu%s",
				    dd_bm_name(bm), blk->nr,
				    le64_to_cpu(h->blocknr),
				    dd_bad_block_text(r));
			return r;
		}
		r = dd_check_txn(bm, blk);
		if (r)
			return r;
		/* Pairs with the acquire above, in other holders. */
		smp_store_release(&aux->validated, true);
	}
	if (le32_to_cpu(h->type) != kind->type || h->array != kind->array ||
	    h->level != kind->level) {
		DMERR_LIMIT("%s: metadata block %llu: type %08x/%u/%u, expected %08x/%u/%u",
			    dd_bm_name(bm), blk->nr, le32_to_cpu(h->type),
			    h->array, h->level, kind->type, kind->array,
			    kind->level);
		return -EILSEQ;
	}
	return 0;
}

static int dd_check_nr(struct dd_bm *bm, u64 nr)
{
	if (nr < DD_FIRST_TREE_BLOCK || nr >= bm->nr_blocks) {
		DMERR_LIMIT("%s: metadata block number %llu out of range",
			    dd_bm_name(bm), nr);
		return -EILSEQ;
	}
	return 0;
}

int dd_bm_read_raw(struct dd_bm *bm, u64 nr, struct dd_block *blk)
{
	struct dm_buffer *buf;
	void *data;

	data = dm_bufio_read(bm->bufio, nr, &buf);
	if (IS_ERR(data))
		return dd_device_error(PTR_ERR(data));
	dd_set_block(bm, blk, buf, data, nr);
	return 0;
}

int dd_bm_read(struct dd_bm *bm, u64 nr, const struct dd_block_kind *kind,
	       struct dd_block *blk)
{
	int r;

	r = dd_check_nr(bm, nr);
	if (r)
		return r;
	r = dd_bm_read_raw(bm, nr, blk);
	if (r)
		return r;
	r = dd_validate(bm, blk, kind);
	if (r)
		dd_bm_release(blk);
	return r;
}

/* Never sleeps on I/O: -EWOULDBLOCK if the block is not in the cache. */
int dd_bm_read_cached(struct dd_bm *bm, u64 nr,
		      const struct dd_block_kind *kind, struct dd_block *blk)
{
	struct dm_buffer *buf;
	void *data;
	int r;

	r = dd_check_nr(bm, nr);
	if (r)
		return r;
	data = dm_bufio_get(bm->bufio, nr, &buf);
	if (IS_ERR(data))
		return dd_device_error(PTR_ERR(data));
	if (!data)
		return -EWOULDBLOCK;
	dd_set_block(bm, blk, buf, data, nr);
	r = dd_validate(bm, blk, kind);
	if (r)
		dd_bm_release(blk);
	return r;
}

static void dd_init_header(struct dd_block *blk, struct dd_bm *bm,
			   const struct dd_block_kind *kind)
{
	struct dd_block_header *h = blk->data;
	struct dd_aux *aux = dm_bufio_get_aux_data(blk->buf);

	h->type = cpu_to_le32(kind->type);
	h->blocknr = cpu_to_le64(blk->nr);
	h->txn = cpu_to_le64(bm->txn);
	h->array = kind->array;
	h->level = kind->level;
	h->reserved1 = 0;
	h->reserved2 = 0;
	aux->validated = true;
}

static int dd_bm_get_new(struct dd_bm *bm, struct dd_block *blk)
{
	struct dm_buffer *buf;
	void *data;
	u64 nr;
	int r;

	r = dd_space_alloc(&bm->space, &nr);
	if (r) {
		DMERR_LIMIT("%s: metadata device is full", dd_bm_name(bm));
		return r;
	}
	data = dm_bufio_new(bm->bufio, nr, &buf);
	if (IS_ERR(data)) {
		dd_space_free_now(&bm->space, nr);
		return dd_device_error(PTR_ERR(data));
	}
	dd_mark_fresh(bm, nr);
	dd_set_block(bm, blk, buf, data, nr);
	return 0;
}

/* A zeroed block of @kind, written by the running transaction. */
int dd_bm_new(struct dd_bm *bm, const struct dd_block_kind *kind,
	      struct dd_block *blk)
{
	int r;

	r = dd_bm_get_new(bm, blk);
	if (r)
		return r;
	memset(blk->data, 0, DD_BLOCK_SIZE);
	dd_init_header(blk, bm, kind);
	return 0;
}

/*
 * A writable version of block @nr. A block already written by the running
 * transaction is not referenced by any commit and is changed in place;
 * otherwise it is copied to a free block and the original is released
 * (still intact on disk until the transaction commits). blk->nr tells the
 * caller where the writable copy lives.
 */
int dd_bm_shadow(struct dd_bm *bm, u64 nr, const struct dd_block_kind *kind,
		 struct dd_block *blk)
{
	struct dd_block old;
	int r;

	r = dd_bm_read(bm, nr, kind, &old);
	if (r)
		return r;
	if (dd_bm_is_fresh(bm, nr)) {
		*blk = old;
		return 0;
	}
	r = dd_bm_get_new(bm, blk);
	if (r) {
		dd_bm_release(&old);
		return r;
	}
	memcpy(blk->data, old.data, DD_BLOCK_SIZE);
	dd_init_header(blk, bm, kind);
	dd_bm_release(&old);
	dd_space_release(&bm->space, nr);
	return 0;
}

/* Start reading blocks [nr, nr + count) into the cache; never waits. */
void dd_bm_prefetch(struct dd_bm *bm, u64 nr, u64 count)
{
	u64 end;

	if (nr >= DD_FIRST_TREE_BLOCK && !check_add_overflow(nr, count, &end) &&
	    end <= bm->nr_blocks)
		dm_bufio_prefetch(bm->bufio, nr, count);
}

void dd_bm_release(struct dd_block *blk)
{
	dm_bufio_release(blk->buf);
	blk->buf = NULL;
	blk->data = NULL;
}

void dd_bm_release_dirty(struct dd_block *blk)
{
	dm_bufio_mark_buffer_dirty(blk->buf);
	dd_bm_release(blk);
}

/*
 * After an abort: no dirty block may outlive this call. dm-bufio can only
 * write dirty buffers, not forget them, so write them; they land on blocks
 * that are free in the committed state, as after a crash. A failed write
 * leaves the buffer clean too. The dead transaction's blocks are nobody's.
 */
void dd_bm_settle(struct dd_bm *bm)
{
	int r = dd_bm_write_all(bm);

	if (r)
		DMWARN_LIMIT("%s: aborted transaction: write-out failed: %d (its blocks are free)",
			     dd_bm_name(bm), r);
	dd_forget_fresh(bm);
}

/*
 * Every block changed by the transaction reaches stable storage:
 * dm_bufio_write_dirty_buffers() waits for the writes, flushes the device
 * and returns the first write error since it was last called, background
 * writeback's included.
 */
int dd_bm_write_all(struct dd_bm *bm)
{
	int r, ahead;

	dd_bm_out_begin(bm);
	clear_bit(DD_BM_BACKGROUND_WRITE, &bm->flags);
	r = dm_bufio_write_dirty_buffers(bm->bufio);
	dd_bm_out_end(bm);
	ahead = xchg(&bm->ahead_error, 0);
	return ahead ?: dd_device_error(r);
}

/*
 * The bulk of a commit's write-out, done while the transaction still
 * changes, so that the commit itself writes only what changed since.
 * Safe at any time: the running transaction's blocks lie where the
 * committed state has free space, as background writeback already
 * knows; a block changed while it is written is dirty again and written
 * again. dm-bufio hands a write error to one waiter only: keep it for the
 * next write-out, and flag it so that writers ask for it before the
 * commit does (dd_bm_writeback_error()).
 */
void dd_bm_write_ahead(struct dd_bm *bm)
{
	int r;

	dd_bm_out_begin(bm);
	r = dd_device_error(dm_bufio_write_dirty_buffers(bm->bufio));
	dd_bm_out_end(bm);
	if (r) {
		cmpxchg(&bm->ahead_error, 0, r);
		set_bit(DD_BM_BACKGROUND_WRITE, &bm->flags);
	}
}

/*
 * Did background writeback fail since the last write-out? dm-bufio forgets
 * a buffer whose write failed, so a block of the running transaction is
 * lost: the caller must abort. Asking means writing out every dirty block
 * now, so ask only after dm-bufio started writing on its own. Needs the
 * same exclusion from commits as dd_bm_write_all(): the error is returned
 * once, to whoever asks first.
 */
bool dd_bm_background_writes(struct dd_bm *bm)
{
	return test_bit(DD_BM_BACKGROUND_WRITE, &bm->flags);
}

int dd_bm_writeback_error(struct dd_bm *bm)
{
	/* One writer asks; those that found the flag with it need not. */
	return test_and_clear_bit(DD_BM_BACKGROUND_WRITE, &bm->flags) ?
	       dd_bm_write_all(bm) : 0;
}

/*
 * The commit point. Slots alternate by generation, so a torn superblock
 * write can only damage the older of the two.
 */
int dd_bm_write_super(struct dd_bm *bm, const struct dd_superblock *sb)
{
	u64 slot = le64_to_cpu(sb->hdr.txn) % DD_SB_SLOTS;
	struct dd_block blk;
	struct dm_buffer *buf;
	void *data;

	data = dm_bufio_new(bm->bufio, slot, &buf);
	if (IS_ERR(data))
		return dd_device_error(PTR_ERR(data));
	dd_set_block(bm, &blk, buf, data, slot);
	memset(data, 0, DD_BLOCK_SIZE);
	memcpy(data, sb, sizeof(*sb));
	dd_hdr(&blk)->blocknr = cpu_to_le64(slot);
	dd_bm_release_dirty(&blk);
	return dd_bm_write_all(bm);
}

struct dd_bm_wait {
	struct completion done;
	struct dd_io_group *group;
};

static void dd_bm_io_end(struct bio *bio)
{
	struct dd_bm_wait *w = bio->bi_private;

	/* Before the waiter is woken: the group may live on its stack. */
	if (w->group)
		dd_io_group_put(w->group, bio->bi_status);
	complete(&w->done);
}

/* One bio at a time; the last one ends @group's part (see dd_io_group). */
static int dd_bm_io(struct dd_bm *bm, blk_opf_t opf, u64 first,
		    struct page **pages, unsigned int nr,
		    struct dd_io_group *group)
{
	struct dd_bm_wait w;
	unsigned int i, n;
	struct bio *bio;
	int r = 0;

	if (first + nr > bm->nr_blocks || first + nr < first)
		return -EINVAL;
	while (!r && nr) {
		n = min_t(unsigned int, nr, BIO_MAX_VECS);
		bio = bio_alloc(bm->bdev, n, opf, GFP_NOIO);
		bio->bi_iter.bi_sector = first * DD_SECTORS_PER_BLOCK;
		for (i = 0; i < n; i++)
			__bio_add_page(bio, pages[i], DD_BLOCK_SIZE, 0);
		init_completion(&w.done);
		w.group = n == nr ? group : NULL;
		bio->bi_private = &w;
		bio->bi_end_io = dd_bm_io_end;
		submit_bio(bio);
		/* As submit_bio_wait(): a stalled disk is not a hung task. */
		while (!wait_for_completion_io_timeout(&w.done, 10 * HZ))
			;
		r = dd_device_error(blk_status_to_errno(bio->bi_status));
		bio_put(bio);
		first += n;
		pages += n;
		nr -= n;
	}
	return r;
}

int dd_bm_read_blocks(struct dd_bm *bm, u64 first, struct page **pages,
		      unsigned int nr)
{
	return dd_bm_io(bm, REQ_OP_READ, first, pages, nr, NULL);
}

int dd_bm_write_blocks(struct dd_bm *bm, u64 first, struct page **pages,
		       unsigned int nr, struct dd_io_group *group)
{
	return dd_bm_io(bm, REQ_OP_WRITE | REQ_SYNC | REQ_FUA, first, pages,
			nr, group);
}
