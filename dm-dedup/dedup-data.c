// SPDX-License-Identifier: GPL-2.0-only
/*
 * Data blocks the target owns; see dedup-data.h.
 */
#include <linux/bio.h>
#include <linux/blkdev.h>
#include <linux/completion.h>
#include <linux/highmem.h>
#include <linux/kmsan.h>
#include <linux/log2.h>
#include <linux/string.h>

#include "dedup-block.h"
#include "dedup-data.h"
#include "dedup-format.h"

/* Pages kept for reuse beyond the reserve, at most (4 MiB). */
#define DD_DATA_KEEP	1024

int dd_data_pool_init(struct dd_data_pool *pool, unsigned int reserve)
{
	unsigned int i;

	BUILD_BUG_ON(DD_BLOCK_SIZE != PAGE_SIZE);
	BUILD_BUG_ON(!is_power_of_2(DD_DATA_STORED));
	for (i = 0; i < DD_DATA_STORED; i++) {
		spin_lock_init(&pool->stored[i].lock);
		pool->stored[i].page = NULL;
	}
	mutex_init(&pool->reserve_lock);
	spin_lock_init(&pool->kept_lock);
	INIT_LIST_HEAD(&pool->kept);
	pool->nr_kept = 0;
	return mempool_init_page_pool(&pool->pages, reserve, 0);
}

void dd_data_pool_exit(struct dd_data_pool *pool)
{
	struct page *page, *tmp;
	unsigned int i;

	/* Also for a pool never set up (zeroed): a constructor that failed. */
	for (i = 0; i < DD_DATA_STORED; i++)
		if (pool->stored[i].page)
			__free_page(pool->stored[i].page);
	if (pool->kept.next)
		list_for_each_entry_safe(page, tmp, &pool->kept, lru)
			__free_page(page);
	mempool_exit(&pool->pages);
}

/* Up to @nr kept pages into @pages; returns how many. */
static unsigned int dd_data_take_kept(struct dd_data_pool *pool,
				      struct page **pages, unsigned int nr)
{
	unsigned int i;

	spin_lock(&pool->kept_lock);
	for (i = 0; i < nr && !list_empty(&pool->kept); i++) {
		pages[i] = list_first_entry(&pool->kept, struct page, lru);
		list_del(&pages[i]->lru);
	}
	pool->nr_kept -= i;
	spin_unlock(&pool->kept_lock);
	return i;
}

/*
 * Pages for @nr blocks. Most come straight from the page allocator; when it
 * has none to spare at once, the writer gives back what it took and waits
 * its turn for the reserve, which writers take one at a time, so that two
 * writers each holding part of it never wait for each other: the rest of
 * the reserve is held by writes that have all their pages and will give
 * them back.
 */
static void dd_data_get(struct dd_data_pool *pool, struct page **pages,
			unsigned int nr)
{
	unsigned int i;

	for (i = dd_data_take_kept(pool, pages, nr); i < nr; i++) {
		pages[i] = alloc_page(GFP_NOWAIT | __GFP_NOWARN);
		if (!pages[i])
			break;
	}
	if (i == nr)
		return;
	while (i--)
		dd_data_put(pool, pages[i]);
	mutex_lock(&pool->reserve_lock);
	for (i = 0; i < nr; i++)
		if (!dd_data_take_kept(pool, &pages[i], 1))
			pages[i] = mempool_alloc(&pool->pages, GFP_NOIO);
	mutex_unlock(&pool->reserve_lock);
}

void dd_data_copy(struct dd_data_pool *pool, struct bio *bio,
		  struct page **pages, unsigned int nr)
{
	unsigned int blk = 0, off = 0, done, len;
	struct bvec_iter iter;
	struct bio_vec bv;
	u8 *src, *dst;

	dd_data_get(pool, pages, nr);
	bio_for_each_segment(bv, bio, iter) {
		/* A segment may end in the next block: unaligned buffers. */
		src = bvec_kmap_local(&bv);
		for (done = 0; done < bv.bv_len; done += len) {
			/* The caller checked the size; this only guards pages. */
			if (WARN_ON_ONCE(blk >= nr))
				break;
			len = min(bv.bv_len - done, DD_BLOCK_SIZE - off);
			dst = kmap_local_page(pages[blk]);
			/*
			 * A whole aligned page goes by copy_page(), in words:
			 * memcpy() of 4 KiB is rep movsb on CPUs with FSRM,
			 * which an emulator (TCG) runs byte by byte, three
			 * times slower than copy_page() in our guest. The
			 * assembly copy is not instrumented: KMSAN is told.
			 */
			if (len == PAGE_SIZE && PAGE_ALIGNED(src + done)) {
				copy_page(dst, src + done);
				kmsan_copy_page_meta(pages[blk], bv.bv_page);
			} else {
				memcpy(dst + off, src + done, len);
			}
			kunmap_local(dst);
			off += len;
			if (off == DD_BLOCK_SIZE) {
				off = 0;
				blk++;
			}
		}
		kunmap_local(src);
	}
}

/*
 * The reserve is refilled first: a writer waiting for it is woken only by
 * a page given back through the mempool.
 */
static bool dd_data_reserve_short(struct dd_data_pool *pool)
{
	return READ_ONCE(pool->pages.curr_nr) < pool->pages.min_nr ||
	       mutex_is_locked(&pool->reserve_lock);
}

void dd_data_put(struct dd_data_pool *pool, struct page *page)
{
	/* With the reserve full and nobody taking from it, kept for reuse. */
	if (dd_data_reserve_short(pool)) {
		mempool_free(page, &pool->pages);
		return;
	}
	spin_lock(&pool->kept_lock);
	if (pool->nr_kept < DD_DATA_KEEP) {
		list_add(&page->lru, &pool->kept);
		pool->nr_kept++;
		page = NULL;
	}
	spin_unlock(&pool->kept_lock);
	if (page)
		__free_page(page);
}

static struct dd_data_stored *dd_data_slot(struct dd_data_pool *pool, u64 pba)
{
	/* A run of blocks stored together fills neighbouring slots. */
	return &pool->stored[pba & (DD_DATA_STORED - 1)];
}

void dd_data_keep_stored(struct dd_data_pool *pool, u64 pba, u64 tag,
			 struct page *page)
{
	struct dd_data_stored *s = dd_data_slot(pool, pba);
	struct page *old;

	/* Short of pages, the slot's copy goes back to the pool as well. */
	if (dd_data_reserve_short(pool)) {
		dd_data_put(pool, page);
		page = NULL;
	}
	spin_lock(&s->lock);
	old = s->page;
	s->pba = pba;
	s->tag = tag;
	s->page = page;
	spin_unlock(&s->lock);
	if (old)
		dd_data_put(pool, old);
}

enum dd_data_kept dd_data_stored_compare(struct dd_data_pool *pool, u64 pba,
					 u64 tag, struct page *page)
{
	struct dd_data_stored *s = dd_data_slot(pool, pba);
	enum dd_data_kept kept = DD_KEPT_NONE;
	struct page *stale = NULL;

	/* Compared under the lock: the next block stored here replaces it. */
	spin_lock(&s->lock);
	if (s->page && s->pba == pba && s->tag == tag)
		kept = dd_data_equal(s->page, page) ? DD_KEPT_SAME :
						      DD_KEPT_DIFFERENT;
	/* Tags only grow: an older one's copy will never count again. */
	if (s->page && s->tag < tag) {
		stale = s->page;
		s->page = NULL;
	}
	spin_unlock(&s->lock);
	if (stale)
		dd_data_put(pool, stale);
	return kept;
}

bool dd_data_is_zero(struct page *page)
{
	void *p = kmap_local_page(page);
	bool zero = !memchr_inv(p, 0, DD_BLOCK_SIZE);

	kunmap_local(p);
	return zero;
}

bool dd_data_equal(struct page *a, struct page *b)
{
	void *p = kmap_local_page(a);
	void *q = kmap_local_page(b);
	bool same = !memcmp(p, q, DD_BLOCK_SIZE);

	kunmap_local(q);
	kunmap_local(p);
	return same;
}

void dd_data_own(struct bio *bio, const struct dd_data_owner *owner)
{
	if (!owner)
		return;
	if (owner->css)
		bio_associate_blkg_from_css(bio, owner->css);
	bio->bi_ioprio = owner->ioprio;
}

/* One block read into @page for @owner, and waited for. */
int dd_data_read_block(struct block_device *bdev, u64 pba, struct page *page,
		       const struct dd_data_owner *owner)
{
	struct bio_vec vec;
	struct bio bio;
	int r;

	bio_init(&bio, bdev, &vec, 1, REQ_OP_READ);
	dd_data_own(&bio, owner);
	bio.bi_iter.bi_sector = pba * DD_SECTORS_PER_BLOCK;
	__bio_add_page(&bio, page, DD_BLOCK_SIZE, 0);
	r = submit_bio_wait(&bio);
	bio_uninit(&bio);
	return dd_device_error(r);
}

static void dd_data_read_endio(struct bio *bio)
{
	struct dd_data_run *run = bio->bi_private;
	struct dd_data_reads *rd = run->reads;
	int r = dd_device_error(blk_status_to_errno(bio->bi_status));
	unsigned int i;

	for (i = 0; i < run->len; i++)
		run->error[i] = r;
	/* Back to the bio pool now: the caller may be waiting for another. */
	bio_put(bio);
	if (atomic_dec_and_test(&rd->pending))
		complete(&rd->done);
}

/*
 * Data blocks @pba[0..@nr) read into @page[] and waited for, all at once,
 * one bio per run of consecutive blocks: the candidates that verify
 * compares for the blocks of a write, which a sequential copy finds side
 * by side. @error[i] is what block i's read returned; @rd is the caller's
 * room for the reads in flight, @owner whom they are for. The bios come
 * from @bs, the target's own pool: the writes it serves may hold the pool
 * of the file system above. Returns the number of bios.
 */
unsigned int dd_data_read(struct block_device *bdev, struct bio_set *bs,
			  const u64 *pba, struct page **page, int *error,
			  unsigned int nr, struct dd_data_reads *rd,
			  const struct dd_data_owner *owner)
{
	unsigned int i, j, len, nr_bio = 0;
	struct blk_plug plug;
	struct bio *bio;

	if (WARN_ON_ONCE(nr > DD_DATA_READS)) {
		for (i = DD_DATA_READS; i < nr; i++)
			error[i] = -EIO;
		nr = DD_DATA_READS;
	}
	atomic_set(&rd->pending, 1);
	init_completion(&rd->done);
	blk_start_plug(&plug);
	for (i = 0; i < nr; i += len) {
		for (len = 1; i + len < nr && pba[i + len] == pba[i] + len; len++)
			;
		rd->run[nr_bio] = (struct dd_data_run){
			.reads = rd, .error = &error[i], .len = len,
		};
		bio = bio_alloc_bioset(bdev, len, REQ_OP_READ, GFP_NOIO, bs);
		dd_data_own(bio, owner);
		bio->bi_iter.bi_sector = pba[i] * DD_SECTORS_PER_BLOCK;
		for (j = 0; j < len; j++)
			__bio_add_page(bio, page[i + j], DD_BLOCK_SIZE, 0);
		bio->bi_end_io = dd_data_read_endio;
		bio->bi_private = &rd->run[nr_bio++];
		atomic_inc(&rd->pending);
		submit_bio(bio);
	}
	blk_finish_plug(&plug);
	if (!atomic_dec_and_test(&rd->pending)) {
		/* As submit_bio_wait(): a stalled disk is not a hung task. */
		while (!wait_for_completion_io_timeout(&rd->done, 10 * HZ))
			;
	}
	return nr_bio;
}
