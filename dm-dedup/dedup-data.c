// SPDX-License-Identifier: GPL-2.0-only
/*
 * Data blocks the target owns; see dedup-data.h.
 */
#include <linux/bio.h>
#include <linux/highmem.h>
#include <linux/string.h>

#include "dedup-data.h"
#include "dedup-format.h"

int dd_data_pool_init(struct dd_data_pool *pool, unsigned int reserve)
{
	BUILD_BUG_ON(DD_BLOCK_SIZE != PAGE_SIZE);
	return mempool_init_page_pool(&pool->pages, reserve, 0);
}

void dd_data_pool_exit(struct dd_data_pool *pool)
{
	mempool_exit(&pool->pages);
}

struct page *dd_data_copy(struct dd_data_pool *pool, struct bio *bio)
{
	struct page *page = mempool_alloc(&pool->pages, GFP_NOIO);
	struct bvec_iter iter;
	unsigned int off = 0;
	struct bio_vec bv;
	u8 *p;

	p = kmap_local_page(page);
	bio_for_each_segment(bv, bio, iter) {
		/* The caller checked the size; this only guards the page. */
		if (WARN_ON_ONCE(off + bv.bv_len > DD_BLOCK_SIZE))
			break;
		memcpy_from_bvec(p + off, &bv);
		off += bv.bv_len;
	}
	kunmap_local(p);
	return page;
}

void dd_data_put(struct dd_data_pool *pool, struct page *page)
{
	mempool_free(page, &pool->pages);
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
