// SPDX-License-Identifier: GPL-2.0-only
/*
 * Userspace implementations behind kshim.h: CRC-32C and a minimal
 * dm-bufio over a file descriptor.
 */
#include <unistd.h>

#include "kshim.h"

struct task_struct kshim_task;

u32 crc32c(u32 crc, const void *p, size_t len)
{
	const u8 *s = p;

	/* The kernel's crc32c(): no pre- or post-inversion. */
	while (len--) {
		crc ^= *s++;
		for (int k = 0; k < 8; k++)
			crc = (crc >> 1) ^ (0x82F63B78 & -(crc & 1));
	}
	return crc;
}

struct dm_buffer {
	struct dm_bufio_client *c;
	u64 block;
	void *data;
	void *aux;
	int hold;
	bool dirty;
};

struct dm_bufio_client {
	struct block_device *bdev;
	unsigned int block_size;
	unsigned int aux_size;
	u64 nr_blocks;
	struct dm_buffer **bufs;
	void (*alloc_cb)(struct dm_buffer *);
	void (*write_cb)(struct dm_buffer *);
};

struct dm_bufio_client *dm_bufio_client_create(struct block_device *bdev, unsigned int block_size,
					       unsigned int reserved, unsigned int aux_size,
					       void (*alloc_cb)(struct dm_buffer *),
					       void (*write_cb)(struct dm_buffer *), unsigned int flags)
{
	struct dm_bufio_client *c = calloc(1, sizeof(*c));

	(void)reserved;
	(void)flags;
	c->bdev = bdev;
	c->block_size = block_size;
	c->aux_size = aux_size;
	c->nr_blocks = bdev->bytes / block_size;
	c->bufs = calloc(c->nr_blocks ? c->nr_blocks : 1, sizeof(*c->bufs));
	c->alloc_cb = alloc_cb;
	c->write_cb = write_cb;
	return c;
}

void dm_bufio_client_destroy(struct dm_bufio_client *c)
{
	for (u64 i = 0; i < c->nr_blocks; i++) {
		if (!c->bufs[i])
			continue;
		if (c->bufs[i]->hold)
			fprintf(stderr, "kshim: block %llu still held at destroy\n",
				(unsigned long long)i);
		free(c->bufs[i]->data);
		free(c->bufs[i]->aux);
		free(c->bufs[i]);
	}
	free(c->bufs);
	free(c);
}

static struct dm_buffer *get_buf(struct dm_bufio_client *c, u64 block, bool *fresh)
{
	struct dm_buffer *b;

	*fresh = false;
	if (block >= c->nr_blocks)
		return NULL;
	b = c->bufs[block];
	if (!b) {
		b = calloc(1, sizeof(*b));
		b->c = c;
		b->block = block;
		b->data = calloc(1, c->block_size);
		b->aux = calloc(1, c->aux_size ? c->aux_size : 1);
		if (c->alloc_cb)
			c->alloc_cb(b);
		c->bufs[block] = b;
		*fresh = true;
	}
	return b;
}

void *dm_bufio_read(struct dm_bufio_client *c, u64 block, struct dm_buffer **bp)
{
	bool fresh;
	struct dm_buffer *b = get_buf(c, block, &fresh);

	if (!b)
		return ERR_PTR(-EIO);
	if (fresh && pread(c->bdev->fd, b->data, c->block_size,
			   (off_t)(block * c->block_size)) != (ssize_t)c->block_size) {
		c->bufs[block] = NULL;
		free(b->data);
		free(b->aux);
		free(b);
		return ERR_PTR(-EIO);
	}
	b->hold++;
	*bp = b;
	return b->data;
}

void *dm_bufio_get(struct dm_bufio_client *c, u64 block, struct dm_buffer **bp)
{
	struct dm_buffer *b = block < c->nr_blocks ? c->bufs[block] : NULL;

	if (!b)
		return NULL;
	b->hold++;
	*bp = b;
	return b->data;
}

void *dm_bufio_new(struct dm_bufio_client *c, u64 block, struct dm_buffer **bp)
{
	bool fresh;
	struct dm_buffer *b = get_buf(c, block, &fresh);

	if (!b)
		return ERR_PTR(-EIO);
	b->hold++;
	*bp = b;
	return b->data;
}

void dm_bufio_prefetch(struct dm_bufio_client *c, u64 block, unsigned int n)
{
	(void)c;
	(void)block;
	(void)n;
}

void dm_bufio_release(struct dm_buffer *b)
{
	if (b->hold <= 0)
		fprintf(stderr, "kshim: release of an unheld block %llu\n",
			(unsigned long long)b->block);
	b->hold--;
}

void dm_bufio_mark_buffer_dirty(struct dm_buffer *b)
{
	b->dirty = true;
}

int dm_bufio_write_dirty_buffers(struct dm_bufio_client *c)
{
	for (u64 i = 0; i < c->nr_blocks; i++) {
		struct dm_buffer *b = c->bufs[i];

		if (!b || !b->dirty)
			continue;
		if (c->write_cb)
			c->write_cb(b);
		if (pwrite(c->bdev->fd, b->data, c->block_size,
			   (off_t)(i * c->block_size)) != (ssize_t)c->block_size)
			return -EIO;
		b->dirty = false;
	}
	/* As the kernel's: the writes are flushed before it returns. */
	return dm_bufio_issue_flush(c);
}

int dm_bufio_issue_flush(struct dm_bufio_client *c)
{
	return fsync(c->bdev->fd) ? -EIO : 0;
}

void *dm_bufio_get_aux_data(struct dm_buffer *b)
{
	return b->aux;
}

void *dm_bufio_get_block_data(struct dm_buffer *b)
{
	return b->data;
}

u64 get_random_u64(void)
{
	return ((u64)random() << 33) ^ ((u64)random() << 2) ^ (u64)random();
}

struct bio *bio_alloc(struct block_device *bdev, unsigned int nr, blk_opf_t opf, int gfp)
{
	struct bio *bio = calloc(1, sizeof(*bio));

	(void)nr;
	(void)gfp;
	bio->bdev = bdev;
	bio->opf = opf;
	return bio;
}

void __bio_add_page(struct bio *bio, struct page *page, unsigned int len, unsigned int off)
{
	(void)len;
	(void)off;
	bio->pages[bio->n++] = page;
}

int submit_bio_wait(struct bio *bio)
{
	off_t pos = (off_t)bio->bi_iter.bi_sector << SECTOR_SHIFT;

	for (unsigned int i = 0; i < bio->n; i++, pos += 4096) {
		ssize_t r = (bio->opf & 1) ?
			pwrite(bio->bdev->fd, bio->pages[i]->data, 4096, pos) :
			pread(bio->bdev->fd, bio->pages[i]->data, 4096, pos);
		if (r != 4096)
			return -EIO;
	}
	return 0;
}

void submit_bio(struct bio *bio)
{
	bio->bi_status = submit_bio_wait(bio) ? BLK_STS_IOERR : BLK_STS_OK;
	bio->bi_end_io(bio);
}

void bio_put(struct bio *bio)
{
	free(bio);
}

/* Linear: the harness's journals are small. */
static size_t xa_find(struct xarray *xa, unsigned long index)
{
	size_t i;

	for (i = 0; i < xa->n && xa->keys[i] != index; i++)
		;
	return i;
}

void *xa_load(struct xarray *xa, unsigned long index)
{
	size_t i = xa_find(xa, index);

	return i < xa->n ? xa->vals[i] : NULL;
}

void *xa_store(struct xarray *xa, unsigned long index, void *entry, int gfp)
{
	size_t i = xa_find(xa, index);
	void *old = NULL;

	(void)gfp;
	if (i < xa->n) {
		old = xa->vals[i];
		xa->vals[i] = entry;
		return old;
	}
	if (xa->n == xa->cap) {
		xa->cap = xa->cap ? 2 * xa->cap : 64;
		xa->keys = realloc(xa->keys, xa->cap * sizeof(*xa->keys));
		xa->vals = realloc(xa->vals, xa->cap * sizeof(*xa->vals));
	}
	xa->keys[xa->n] = index;
	xa->vals[xa->n++] = entry;
	return NULL;
}

void xa_destroy(struct xarray *xa)
{
	free(xa->keys);
	free(xa->vals);
	xa_init(xa);
}
