/* SPDX-License-Identifier: GPL-2.0-only */
/*
 * Data blocks the target owns.
 *
 * A write's 4 KiB is copied into a page of ours before anything is
 * decided about it. The submitter's pages are not ours to trust: an
 * O_DIRECT or io_uring buffer belongs to the user and may change while the
 * write is in flight, and without stable writes so may a page-cache page
 * under writeback. The zero test, the fingerprint, a verify compare and
 * the data write all read the copy, so the fingerprint always describes
 * the bytes that reach the data device.
 *
 * The copies come from a mempool so that writes make progress under
 * memory pressure; a write holds its copy until it completes, which never
 * needs another copy.
 */
#ifndef DM_DEDUP_DATA_H
#define DM_DEDUP_DATA_H

#include <linux/mempool.h>
#include <linux/types.h>

struct bio;
struct page;

struct dd_data_pool {
	mempool_t pages;
};

int dd_data_pool_init(struct dd_data_pool *pool, unsigned int reserve);
void dd_data_pool_exit(struct dd_data_pool *pool);

/* A copy of the one 4 KiB block @bio carries. May sleep; never fails. */
struct page *dd_data_copy(struct dd_data_pool *pool, struct bio *bio);
void dd_data_put(struct dd_data_pool *pool, struct page *page);

bool dd_data_is_zero(struct page *page);
bool dd_data_equal(struct page *a, struct page *b);

#endif
