/* SPDX-License-Identifier: GPL-2.0-only */
/*
 * Just enough of the kernel API for dm-dedup's metadata code
 * (dedup-block.c, dedup-array.c, dedup-space.c, dedup-metadata.c) to build
 * and run in userspace, over a file, so that the tools' tests can check
 * what the real kernel code writes and have it open what the tools write.
 * dm-bufio is a never-evicting cache; writes reach the file only when the
 * metadata code asks for them. Little-endian hosts only.
 */
#ifndef DEDUP_KSHIM_H
#define DEDUP_KSHIM_H

#include <errno.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#if __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the kernel-compat shim assumes a little-endian host"
#endif

typedef uint8_t u8;
typedef uint16_t u16;
typedef uint32_t u32;
typedef unsigned long long u64;
typedef long long s64;
typedef uint8_t __u8;
typedef uint16_t __le16;
typedef uint32_t __le32;
typedef unsigned long long __le64;

#define __packed __attribute__((packed))
#define SECTOR_SHIFT 9
#define BIT(n) (1UL << (n))
#define U32_MAX UINT32_MAX
#define U64_MAX UINT64_MAX
#define check_add_overflow(a, b, d) __builtin_add_overflow(a, b, d)
#define DMWARN_LIMIT DMERR

#define cpu_to_le16(x) ((__le16)(x))
#define cpu_to_le32(x) ((__le32)(x))
#define cpu_to_le64(x) ((__le64)(x))
#define le16_to_cpu(x) ((u16)(x))
#define le32_to_cpu(x) ((u32)(x))
#define le64_to_cpu(x) ((u64)(x))
/* A load from any address, as the kernel's <linux/unaligned.h> has it. */
#define get_unaligned(p) ({ __typeof__(+*(p)) v_; memcpy(&v_, (p), sizeof(v_)); v_; })

#define GFP_KERNEL 0
#define GFP_NOIO 0
static inline void *kzalloc(size_t n, int gfp) { (void)gfp; return calloc(1, n ? n : 1); }
static inline void *kmalloc(size_t n, int gfp) { (void)gfp; return malloc(n ? n : 1); }
static inline void kfree(const void *p) { free((void *)p); }
static inline void *kvcalloc(size_t n, size_t s, int gfp) { (void)gfp; return calloc(n ? n : 1, s); }
static inline void *kvmalloc_array(size_t n, size_t s, int gfp) { (void)gfp; return calloc(n ? n : 1, s); }
static inline size_t array_size(size_t n, size_t s)
{
	size_t r;

	return __builtin_mul_overflow(n, s, &r) ? SIZE_MAX : r;
}
static inline void kvfree(const void *p) { free((void *)p); }
static inline void *kcalloc(size_t n, size_t s, int gfp) { (void)gfp; return calloc(n ? n : 1, s); }
static inline void *kmalloc_array(size_t n, size_t s, int gfp) { (void)gfp; return malloc(n && s ? n * s : 1); }

#define min_t(t, a, b) ((t)(a) < (t)(b) ? (t)(a) : (t)(b))
#define max_t(t, a, b) ((t)(a) > (t)(b) ? (t)(a) : (t)(b))
#define max(a, b) ((a) > (b) ? (a) : (b))
#define clamp_t(t, v, lo, hi) min_t(t, max_t(t, v, lo), hi)
#define DIV_ROUND_UP_ULL(n, d) (((u64)(n) + (d) - 1) / (d))
#define min(a, b) ((a) < (b) ? (a) : (b))
#define WARN_ON_ONCE(c) ({ int __c = !!(c); if (__c) fprintf(stderr, "WARN_ON_ONCE %s:%d\n", __FILE__, __LINE__); __c; })
#define cond_resched() do { } while (0)
/* One thread: every caller is the same task. */
struct task_struct { int unused; };
extern struct task_struct kshim_task;
#define current (&kshim_task)

#define DMERR(fmt, ...) fprintf(stderr, "dedup: " fmt "\n", ##__VA_ARGS__)
#define DMERR_LIMIT DMERR
#define DMWARN DMERR
#define DMINFO(fmt, ...) do { if (getenv("KSHIM_VERBOSE")) DMERR(fmt, ##__VA_ARGS__); } while (0)

#define MAX_ERRNO 4095
static inline void *ERR_PTR(long e) { return (void *)e; }
static inline long PTR_ERR(const void *p) { return (long)p; }
static inline bool IS_ERR(const void *p) { return (unsigned long)p >= (unsigned long)-MAX_ERRNO; }

static inline u64 div64_u64(u64 a, u64 b) { return a / b; }
static inline u64 div_u64(u64 a, u32 b) { return a / b; }
static inline u64 div_u64_rem(u64 a, u32 b, u32 *r) { *r = a % b; return a / b; }
#define do_div(n, base) ({ u32 __r = (u32)((n) % (base)); (n) /= (base); __r; })

#define BITS_PER_LONG 64
#define BITS_TO_LONGS(n) (((n) + BITS_PER_LONG - 1) / BITS_PER_LONG)
#define BIT_WORD(nr) ((nr) / BITS_PER_LONG)
#define ARRAY_SIZE(a) (sizeof(a) / sizeof((a)[0]))
static inline bool test_bit(u64 nr, const unsigned long *a)
{
	return (a[nr / BITS_PER_LONG] >> (nr % BITS_PER_LONG)) & 1;
}
static inline unsigned int __ffs64(u64 w) { return (unsigned int)__builtin_ctzll(w); }
static inline void __set_bit(u64 nr, unsigned long *a) { a[nr / BITS_PER_LONG] |= 1UL << (nr % BITS_PER_LONG); }
static inline void __clear_bit(u64 nr, unsigned long *a) { a[nr / BITS_PER_LONG] &= ~(1UL << (nr % BITS_PER_LONG)); }
/* One thread here: the atomic forms are the plain ones. */
#define set_bit(nr, a) __set_bit(nr, a)
#define clear_bit(nr, a) __clear_bit(nr, a)
static inline bool test_and_clear_bit(u64 nr, unsigned long *a)
{
	bool old = test_bit(nr, a);

	__clear_bit(nr, a);
	return old;
}
#define READ_ONCE(x) (x)
#define smp_load_acquire(p) (*(p))
#define smp_store_release(p, v) (*(p) = (v))
#define smp_rmb() ((void)0)

/* The harness is single-threaded: locks and their assertions do nothing. */
struct rw_semaphore { int unused; };
#define init_rwsem(s) ((void)(s))
#define down_read(s) ((void)(s))
#define down_read_trylock(s) ((void)(s), 1)
#define up_read(s) ((void)(s))
#define down_write(s) ((void)(s))
#define up_write(s) ((void)(s))
#define downgrade_write(s) ((void)(s))
#define lockdep_assert_held(l) ((void)(l))
#define lockdep_assert_held_read(l) ((void)(l))
#define lockdep_assert_held_write(l) ((void)(l))
#define lockdep_assert(c) ((void)0)
struct mutex { int unused; };
#define mutex_init(m) ((void)(m))
#define mutex_lock(m) ((void)(m))
#define mutex_unlock(m) ((void)(m))
typedef struct { int unused; } spinlock_t;
#define spin_lock_init(l) ((void)(l))
#define spin_lock(l) ((void)(l))
#define spin_unlock(l) ((void)(l))
typedef struct { int counter; } atomic_t;
#define atomic_read(a) ((a)->counter)
#define atomic_inc(a) ((void)((a)->counter++))
#define atomic_dec(a) ((void)((a)->counter--))
#define atomic_set(a, v) ((a)->counter = (v))
#define atomic_dec_and_test(a) (--(a)->counter == 0)
/* One thread: an exchange is a read and a write. */
#define xchg(p, v) ({ __typeof__(*(p)) __old = *(p); *(p) = (v); __old; })
#define cmpxchg(p, o, n) ({ __typeof__(*(p)) __old = *(p); \
			    *(p) = __old == (o) ? (n) : __old; __old; })
typedef struct { s64 counter; } atomic64_t;
#define atomic64_set(a, v) ((a)->counter = (v))
#define atomic64_read(a) ((a)->counter)
#define atomic64_add(v, a) ((void)((a)->counter += (v)))
#define atomic64_sub(v, a) ((void)((a)->counter -= (v)))
static inline bool atomic64_try_cmpxchg(atomic64_t *a, s64 *old, s64 new)
{
	if (a->counter == *old) {
		a->counter = new;
		return true;
	}
	*old = a->counter;
	return false;
}
/* One CPU: a per-CPU variable is one object. */
#define __percpu
#define alloc_percpu(type) ((type *)calloc(1, sizeof(type)))
#define free_percpu(p) free(p)
#define raw_cpu_ptr(p) (p)
#define per_cpu_ptr(p, cpu) ((void)(cpu), (p))
#define for_each_possible_cpu(cpu) for ((cpu) = 0; (cpu) < 1; (cpu)++)
#define WRITE_ONCE(x, v) ((x) = (v))
static inline bool __test_and_set_bit(u64 nr, unsigned long *a)
{
	bool old = test_bit(nr, a);

	__set_bit(nr, a);
	return old;
}
static inline unsigned long find_next_bit(const unsigned long *a, unsigned long size, unsigned long off)
{
	for (; off < size; off++)
		if (test_bit(off, a))
			return off;
	return size;
}
static inline unsigned long find_next_zero_bit(const unsigned long *a, unsigned long size, unsigned long off)
{
	for (; off < size; off++)
		if (!test_bit(off, a))
			return off;
	return size;
}
static inline unsigned long find_first_bit(const unsigned long *a, unsigned long size)
{
	return find_next_bit(a, size, 0);
}
static inline void bitmap_set(unsigned long *a, unsigned long start, unsigned long n)
{
	while (n--)
		__set_bit(start++, a);
}
static inline void bitmap_clear(unsigned long *a, unsigned long start, unsigned long n)
{
	while (n--)
		__clear_bit(start++, a);
}

static inline void *memchr_inv(const void *p, int c, size_t n)
{
	const u8 *s = p;

	for (size_t i = 0; i < n; i++)
		if (s[i] != (u8)c)
			return (void *)(s + i);
	return NULL;
}

static inline long strscpy(char *dst, const char *src, size_t n)
{
	size_t len = strnlen(src, n);

	if (len == n) {
		memcpy(dst, src, n - 1);
		dst[n - 1] = 0;
		return -E2BIG;
	}
	memcpy(dst, src, len + 1);
	return (long)len;
}

/* KSHIM_TIME fixes the clock, for reproducible images. */
static inline s64 ktime_get_real_seconds(void)
{
	const char *t = getenv("KSHIM_TIME");

	return t ? strtoll(t, NULL, 10) : (s64)time(NULL);
}

struct block_device {
	int fd;
	u64 bytes;
};
static inline u64 bdev_nr_bytes(struct block_device *b) { return b->bytes; }

#define NSEC_PER_MSEC 1000000ULL
static inline u64 ktime_get_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (u64)ts.tv_sec * 1000000000ULL + ts.tv_nsec;
}
u64 get_random_u64(void);

/* Pages: one 4 KiB buffer each. */
struct page { unsigned char data[4096]; };
static inline struct page *alloc_page(int gfp) { (void)gfp; return calloc(1, sizeof(struct page)); }
static inline void __free_page(struct page *p) { free(p); }
static inline void *page_address(struct page *p) { return p->data; }

/*
 * Bios: synchronous reads and writes of whole pages on the file; a bio
 * submitted is done, and its end_io called, before submit_bio() returns.
 */
typedef unsigned int blk_opf_t;
typedef u8 blk_status_t;
#define BLK_STS_OK	0
#define BLK_STS_IOERR	10
static inline int blk_status_to_errno(blk_status_t s) { return s ? -EIO : 0; }
struct completion { int done; };
static inline void init_completion(struct completion *c) { c->done = 0; }
static inline void complete(struct completion *c) { c->done = 1; }
#define HZ 100
static inline unsigned long wait_for_completion_io_timeout(struct completion *c,
							   unsigned long t)
{
	(void)t;
	return c->done;
}
#define REQ_OP_READ	0U
#define REQ_OP_WRITE	1U
#define REQ_SYNC	(1U << 8)
#define REQ_FUA		(1U << 9)
#define BIO_MAX_VECS	256U
struct bio {
	struct block_device *bdev;
	blk_opf_t opf;
	struct { u64 bi_sector; } bi_iter;
	unsigned int n;
	struct page *pages[BIO_MAX_VECS];
	blk_status_t bi_status;
	void *bi_private;
	void (*bi_end_io)(struct bio *bio);
};
struct bio *bio_alloc(struct block_device *bdev, unsigned int nr, blk_opf_t opf, int gfp);
void __bio_add_page(struct bio *bio, struct page *page, unsigned int len, unsigned int off);
int submit_bio_wait(struct bio *bio);
void submit_bio(struct bio *bio);
void bio_put(struct bio *bio);

/* An xarray of value entries: enough for a map overlay. */
struct xarray { u64 *keys; void **vals; size_t n, cap; };
static inline void xa_init(struct xarray *xa) { memset(xa, 0, sizeof(*xa)); }
static inline void *xa_mk_value(unsigned long v) { return (void *)((v << 1) | 1); }
static inline unsigned long xa_to_value(const void *e) { return (unsigned long)e >> 1; }
static inline int xa_err(void *e) { (void)e; return 0; }
void *xa_load(struct xarray *xa, unsigned long index);
void *xa_store(struct xarray *xa, unsigned long index, void *entry, int gfp);
void xa_destroy(struct xarray *xa);

u32 crc32c(u32 crc, const void *p, size_t len);

struct dm_buffer;
struct dm_bufio_client;
struct dm_bufio_client *dm_bufio_client_create(struct block_device *bdev, unsigned int block_size,
					       unsigned int reserved, unsigned int aux_size,
					       void (*alloc_cb)(struct dm_buffer *),
					       void (*write_cb)(struct dm_buffer *), unsigned int flags);
void dm_bufio_client_destroy(struct dm_bufio_client *c);
void *dm_bufio_read(struct dm_bufio_client *c, u64 block, struct dm_buffer **bp);
void *dm_bufio_get(struct dm_bufio_client *c, u64 block, struct dm_buffer **bp);
void *dm_bufio_new(struct dm_bufio_client *c, u64 block, struct dm_buffer **bp);
void dm_bufio_prefetch(struct dm_bufio_client *c, u64 block, unsigned int n);
void dm_bufio_release(struct dm_buffer *b);
void dm_bufio_mark_buffer_dirty(struct dm_buffer *b);
int dm_bufio_write_dirty_buffers(struct dm_bufio_client *c);
int dm_bufio_issue_flush(struct dm_bufio_client *c);
void *dm_bufio_get_aux_data(struct dm_buffer *b);
void *dm_bufio_get_block_data(struct dm_buffer *b);

#endif
