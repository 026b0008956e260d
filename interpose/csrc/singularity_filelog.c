/*
 * LD_PRELOAD shim for a job's processes: records the node-local files they open for writing.
 *
 * A job checkpointed with CRIU may be restored on another node, where the files it wrote on node-local
 * storage (/tmp, /var/tmp, /dev/shm, node scratch) do not exist. The node agent carries those files in
 * the checkpoint; this shim tells it which ones by appending "<absolute path>\n" to a log each time a
 * call that can create or write a file under a node-local prefix succeeds. Lines repeat; the reader
 * (interpose/filelog.py) removes duplicates.
 *
 * Environment, read once per process:
 *   SINGULARITY_FILELOG      absolute path of the log; unset, empty or relative: the shim does nothing
 *   SINGULARITY_LOCAL_PATHS  colon-separated absolute prefixes (unset: /tmp:/var/tmp:/dev/shm); a
 *                            prefix matches itself and what lies under it, on a component boundary
 *
 * Paths are made absolute lexically (cwd or the directory descriptor, then "." and ".." folded), not
 * through symlinks: the agent copies and puts back files by the name the job used.
 *
 * The host program must never notice the shim: every failure inside it only skips a log line, and
 * errno is what the real call left. The log is written by the job's own processes, so whoever reads
 * it must treat its content as untrusted.
 *
 * Build: cc -shared -fPIC -O2 -Wall -Wextra -o singularity_filelog.so singularity_filelog.c -ldl
 */
/* The definitions below must be the plain symbols, not fortified inlines or LFS redirects. */
#undef _FORTIFY_SOURCE
#undef _FILE_OFFSET_BITS
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define DEFAULT_LOCAL_PATHS "/tmp:/var/tmp:/dev/shm"
#define MAX_PREFIXES 64

/* glibc's fortify entry points, called by programs built with _FORTIFY_SOURCE; not declared here. */
int __open_2(const char *path, int flags);
int __open64_2(const char *path, int flags);
int __openat_2(int dirfd, const char *path, int flags);
int __openat64_2(int dirfd, const char *path, int flags);

/* --- configuration, read once ----------------------------------------------------------------- */

static char log_path[PATH_MAX];
static size_t log_len;
static char prefix_buf[8192];
static const char *prefixes[MAX_PREFIXES];
static size_t prefix_lens[MAX_PREFIXES];
static int nprefixes;
static int config_state; /* 0 unread, 1 being read, 2 ready */

/* Fold "//", "." and ".." of an absolute path in place (it only shrinks); returns its length. */
static size_t normalise(char *p)
{
	char *r = p, *w = p;
	while (*r) {
		char *end;
		size_t n;
		while (*r == '/')
			r++;
		if (!*r)
			break;
		end = strchrnul(r, '/');
		n = (size_t) (end - r);
		if (n == 2 && r[0] == '.' && r[1] == '.') {
			while (w > p && *--w != '/')
				;
		} else if (!(n == 1 && r[0] == '.')) {
			*w++ = '/';
			memmove(w, r, n);
			w += n;
		}
		r = end;
	}
	if (w == p)
		*w++ = '/';
	*w = '\0';
	return (size_t) (w - p);
}

static void read_config(void)
{
	const char *log = getenv("SINGULARITY_FILELOG");
	const char *local = getenv("SINGULARITY_LOCAL_PATHS");
	char *s;
	/* A relative log would name a different file in every working directory: refuse it. */
	if (!log || log[0] != '/' || strlen(log) >= sizeof(log_path))
		return;
	if (!local)
		local = DEFAULT_LOCAL_PATHS;
	if (strlen(local) >= sizeof(prefix_buf))
		return;
	strcpy(prefix_buf, local);
	for (s = prefix_buf; s && nprefixes < MAX_PREFIXES;) {
		char *next = strchr(s, ':');
		if (next)
			*next++ = '\0';
		if (s[0] == '/') {
			prefix_lens[nprefixes] = normalise(s);
			prefixes[nprefixes++] = s;
		}
		s = next;
	}
	strcpy(log_path, log);
	log_len = normalise(log_path);
}

/*
 * Whether the configuration may be used. A thread arriving while another reads it skips its line
 * rather than waiting: that can only happen before main (libraries starting threads from their
 * constructors), and waiting could hang forever in a child forked meanwhile. pthread_once is not used
 * because before glibc 2.34 it lives in libpthread, which the host program may not load.
 */
static int config_ready(void)
{
	int state = __atomic_load_n(&config_state, __ATOMIC_ACQUIRE);
	if (state == 2)
		return 1;
	if (state == 0 && __atomic_compare_exchange_n(&config_state, &state, 1, 0, __ATOMIC_ACQ_REL,
						      __ATOMIC_ACQUIRE)) {
		read_config();
		__atomic_store_n(&config_state, 2, __ATOMIC_RELEASE);
		return 1;
	}
	return 0;
}

__attribute__((constructor)) static void filelog_init(void)
{
	config_ready();
}

/* --- the real functions ------------------------------------------------------------------------ */

/* Resolved on first use, so calls from other libraries' constructors, made before ours, work too. */
static void *resolve(void **slot, const char *name)
{
	void *fn = __atomic_load_n(slot, __ATOMIC_ACQUIRE);
	if (!fn) {
		fn = dlsym(RTLD_NEXT, name);
		__atomic_store_n(slot, fn, __ATOMIC_RELEASE);
	}
	return fn;
}

#define REAL(fn) ((__typeof__(&fn)) resolve(&real_##fn, #fn))
static void *real_open, *real_open64, *real_openat, *real_openat64, *real_creat, *real_creat64,
	*real___open_2, *real___open64_2, *real___openat_2, *real___openat64_2, *real_fopen,
	*real_fopen64, *real_freopen, *real_freopen64, *real_rename, *real_renameat, *real_renameat2,
	*real_mkstemp, *real_mkostemp, *real_mkstemps, *real_mkostemps, *real_mkstemp64,
	*real_mkostemp64, *real_mkstemps64, *real_mkostemps64;

/* --- the log ----------------------------------------------------------------------------------- */

/* Kept open per process (inherited across fork, closed on exec where the new image opens its own). */
static int log_fd = -1;
static dev_t log_dev;
static ino_t log_ino;

static int open_log(void)
{
	__typeof__(&open) real = REAL(open);
	return real ? real(log_path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0600) : -1;
}

/*
 * Whether fd still names the log. Programs that close descriptors they do not own (daemons, a
 * closerange after fork) can get our number back for a file of theirs, which a log line would
 * corrupt. After a CRIU restore the descriptor names the restored log, a new inode at the same path.
 */
static int names_log(int fd)
{
	struct stat st, now;
	if (fstat(fd, &st) != 0)
		return 0;
	if (st.st_dev == __atomic_load_n(&log_dev, __ATOMIC_RELAXED) &&
	    st.st_ino == __atomic_load_n(&log_ino, __ATOMIC_RELAXED))
		return 1;
	if (stat(log_path, &now) != 0 || now.st_dev != st.st_dev || now.st_ino != st.st_ino)
		return 0;
	__atomic_store_n(&log_dev, st.st_dev, __ATOMIC_RELAXED);
	__atomic_store_n(&log_ino, st.st_ino, __ATOMIC_RELAXED);
	return 1;
}

/* One write(2) per line: O_APPEND makes it land whole even with many writers. */
static void append_line(const char *line, size_t len)
{
	struct stat st;
	int fd = __atomic_load_n(&log_fd, __ATOMIC_ACQUIRE);
	int fresh;
	if (fd >= 0 && names_log(fd)) {
		if (write(fd, line, len) < 0) {
			/* nothing to do: a lost line only means a file that may not follow the job */
		}
		return;
	}
	fresh = open_log();
	if (fresh < 0)
		return;
	if (write(fresh, line, len) < 0) {
		/* as above */
	}
	if (fstat(fresh, &st) == 0) {
		__atomic_store_n(&log_dev, st.st_dev, __ATOMIC_RELAXED);
		__atomic_store_n(&log_ino, st.st_ino, __ATOMIC_RELAXED);
	}
	/*
	 * Adopt the fresh descriptor. A stale number is left alone: it may be the program's now (when the
	 * log file was replaced instead, that leaks one descriptor per replacement). Of two threads racing
	 * here, the loser closes its own.
	 */
	if (!__atomic_compare_exchange_n(&log_fd, &fd, fresh, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
		close(fresh);
}

/* Write `path` (relative to dirfd) to the log if it lies under a node-local prefix. */
static void note_path(int dirfd, const char *path)
{
	char buf[PATH_MAX];
	size_t base = 0, plen, len;
	int saved = errno;
	if (!config_ready() || !log_len || !path)
		goto out;
	if (path[0] != '/') {
		if (dirfd == AT_FDCWD) {
			if (!getcwd(buf, sizeof(buf)) || buf[0] != '/')
				goto out;
			base = strlen(buf);
		} else {
			char link[32];
			ssize_t n;
			snprintf(link, sizeof(link), "/proc/self/fd/%d", dirfd);
			n = readlink(link, buf, sizeof(buf) - 1);
			if (n <= 0 || buf[0] != '/')
				goto out;
			base = (size_t) n;
		}
	}
	plen = strlen(path);
	if (base + 1 + plen + 1 > sizeof(buf))
		goto out;
	buf[base] = '/';
	memcpy(buf + base + 1, path, plen + 1);
	len = normalise(buf);
	/* A name holding a newline would read as two lines, the second one chosen by the job. */
	if (memchr(buf, '\n', len))
		goto out;
	if (len == log_len && memcmp(buf, log_path, len) == 0)
		goto out;
	for (int i = 0; i < nprefixes; i++) {
		size_t n = prefix_lens[i];
		if (len >= n && memcmp(buf, prefixes[i], n) == 0 &&
		    (buf[n] == '\0' || buf[n] == '/' || n == 1)) {
			buf[len] = '\n';
			append_line(buf, len + 1);
			break;
		}
	}
out:
	errno = saved;
}

/* The descriptor's own name: "" relative to the descriptor itself. */
static void note_fd(int fd)
{
	note_path(fd, "");
}

static int writes(int flags)
{
#ifdef O_PATH
	if (flags & O_PATH)
		return 0;
#endif
#ifdef O_TMPFILE
	/* An unnamed file in that directory: nothing to carry unless it is linked in, which we do not see. */
	if ((flags & O_TMPFILE) == O_TMPFILE)
		return 0;
#endif
	return (flags & O_ACCMODE) != O_RDONLY || (flags & (O_CREAT | O_TRUNC | O_APPEND));
}

static int mode_writes(const char *mode)
{
	/* glibc allows ",ccs=CHARSET" after the mode letters. */
	for (; mode && *mode && *mode != ','; mode++)
		if (*mode == 'w' || *mode == 'a' || *mode == '+')
			return 1;
	return 0;
}

static int no_real(void)
{
	errno = ENOSYS;
	return -1;
}

/* --- the interposed calls ---------------------------------------------------------------------- */

#ifdef O_TMPFILE
#define NEEDS_MODE(flags) (((flags) & O_CREAT) || ((flags) & O_TMPFILE) == O_TMPFILE)
#else
#define NEEDS_MODE(flags) ((flags) & O_CREAT)
#endif

/* The mode is only there when the flags say so; reading it otherwise reads garbage. */
#define TAKE_MODE(flags, last, mode)                          \
	do {                                                  \
		if (NEEDS_MODE(flags)) {                      \
			va_list ap;                           \
			va_start(ap, last);                   \
			mode = (mode_t) va_arg(ap, int);      \
			va_end(ap);                           \
		}                                             \
	} while (0)

#define OPEN_LIKE(fn)                                                         \
	int fn(const char *path, int flags, ...)                              \
	{                                                                     \
		mode_t mode = 0;                                              \
		__typeof__(&fn) real = REAL(fn);                              \
		int fd;                                                       \
		TAKE_MODE(flags, flags, mode);                                \
		if (!real)                                                    \
			return no_real();                                     \
		fd = real(path, flags, mode);                                 \
		if (fd >= 0 && writes(flags))                                 \
			note_path(AT_FDCWD, path);                            \
		return fd;                                                    \
	}

#define OPENAT_LIKE(fn)                                                       \
	int fn(int dirfd, const char *path, int flags, ...)                   \
	{                                                                     \
		mode_t mode = 0;                                              \
		__typeof__(&fn) real = REAL(fn);                              \
		int fd;                                                       \
		TAKE_MODE(flags, flags, mode);                                \
		if (!real)                                                    \
			return no_real();                                     \
		fd = real(dirfd, path, flags, mode);                          \
		if (fd >= 0 && writes(flags))                                 \
			note_path(dirfd, path);                               \
		return fd;                                                    \
	}

OPEN_LIKE(open)
OPEN_LIKE(open64)
OPENAT_LIKE(openat)
OPENAT_LIKE(openat64)

#define CREAT_LIKE(fn)                                                        \
	int fn(const char *path, mode_t mode)                                 \
	{                                                                     \
		__typeof__(&fn) real = REAL(fn);                              \
		int fd;                                                       \
		if (!real)                                                    \
			return no_real();                                     \
		fd = real(path, mode);                                        \
		if (fd >= 0)                                                  \
			note_path(AT_FDCWD, path);                            \
		return fd;                                                    \
	}

CREAT_LIKE(creat)
CREAT_LIKE(creat64)

#define OPEN_2_LIKE(fn)                                                       \
	int fn(const char *path, int flags)                                   \
	{                                                                     \
		__typeof__(&fn) real = REAL(fn);                              \
		int fd;                                                       \
		if (!real)                                                    \
			return no_real();                                     \
		fd = real(path, flags);                                       \
		if (fd >= 0 && writes(flags))                                 \
			note_path(AT_FDCWD, path);                            \
		return fd;                                                    \
	}

#define OPENAT_2_LIKE(fn)                                                     \
	int fn(int dirfd, const char *path, int flags)                        \
	{                                                                     \
		__typeof__(&fn) real = REAL(fn);                              \
		int fd;                                                       \
		if (!real)                                                    \
			return no_real();                                     \
		fd = real(dirfd, path, flags);                                \
		if (fd >= 0 && writes(flags))                                 \
			note_path(dirfd, path);                               \
		return fd;                                                    \
	}

OPEN_2_LIKE(__open_2)
OPEN_2_LIKE(__open64_2)
OPENAT_2_LIKE(__openat_2)
OPENAT_2_LIKE(__openat64_2)

#define FOPEN_LIKE(fn)                                                        \
	FILE *fn(const char *path, const char *mode)                          \
	{                                                                     \
		__typeof__(&fn) real = REAL(fn);                              \
		FILE *f;                                                      \
		if (!real) {                                                  \
			errno = ENOSYS;                                       \
			return NULL;                                          \
		}                                                             \
		f = real(path, mode);                                         \
		if (f && mode_writes(mode))                                   \
			note_path(AT_FDCWD, path);                            \
		return f;                                                     \
	}

/* A NULL path reopens the stream's own file with a new mode: name it by its descriptor. */
#define FREOPEN_LIKE(fn)                                                      \
	FILE *fn(const char *path, const char *mode, FILE *stream)            \
	{                                                                     \
		__typeof__(&fn) real = REAL(fn);                              \
		FILE *f;                                                      \
		if (!real) {                                                  \
			errno = ENOSYS;                                       \
			return NULL;                                          \
		}                                                             \
		f = real(path, mode, stream);                                 \
		if (f && mode_writes(mode)) {                                 \
			if (path)                                             \
				note_path(AT_FDCWD, path);                    \
			else                                                  \
				note_fd(fileno(f));                           \
		}                                                             \
		return f;                                                     \
	}

FOPEN_LIKE(fopen)
FOPEN_LIKE(fopen64)
FREOPEN_LIKE(freopen)
FREOPEN_LIKE(freopen64)

/* Write-to-temp-then-rename is how careful programs save files: the new name is what must follow. */
int rename(const char *old, const char *new)
{
	__typeof__(&rename) real = REAL(rename);
	int ret;
	if (!real)
		return no_real();
	ret = real(old, new);
	if (ret == 0)
		note_path(AT_FDCWD, new);
	return ret;
}

int renameat(int olddirfd, const char *old, int newdirfd, const char *new)
{
	__typeof__(&renameat) real = REAL(renameat);
	int ret;
	if (!real)
		return no_real();
	ret = real(olddirfd, old, newdirfd, new);
	if (ret == 0)
		note_path(newdirfd, new);
	return ret;
}

#ifdef RENAME_EXCHANGE
int renameat2(int olddirfd, const char *old, int newdirfd, const char *new, unsigned int flags)
{
	__typeof__(&renameat2) real = REAL(renameat2);
	int ret;
	if (!real)
		return no_real();
	ret = real(olddirfd, old, newdirfd, new, flags);
	if (ret == 0) {
		note_path(newdirfd, new);
		if (flags & RENAME_EXCHANGE)
			note_path(olddirfd, old);
	}
	return ret;
}
#endif

/*
 * glibc's mkstemp opens through an internal call the shim cannot see; the name is in the template.
 * The 64 variants are what programs built with _FILE_OFFSET_BITS=64 call.
 */
#define MKSTEMP_LIKE(fn, params, args)                                        \
	int fn params                                                         \
	{                                                                     \
		__typeof__(&fn) real = REAL(fn);                              \
		int fd;                                                       \
		if (!real)                                                    \
			return no_real();                                     \
		fd = real args;                                               \
		if (fd >= 0)                                                  \
			note_path(AT_FDCWD, tmpl);                            \
		return fd;                                                    \
	}

MKSTEMP_LIKE(mkstemp, (char *tmpl), (tmpl))
MKSTEMP_LIKE(mkostemp, (char *tmpl, int flags), (tmpl, flags))
MKSTEMP_LIKE(mkstemps, (char *tmpl, int suffixlen), (tmpl, suffixlen))
MKSTEMP_LIKE(mkostemps, (char *tmpl, int suffixlen, int flags), (tmpl, suffixlen, flags))
MKSTEMP_LIKE(mkstemp64, (char *tmpl), (tmpl))
MKSTEMP_LIKE(mkostemp64, (char *tmpl, int flags), (tmpl, flags))
MKSTEMP_LIKE(mkstemps64, (char *tmpl, int suffixlen), (tmpl, suffixlen))
MKSTEMP_LIKE(mkostemps64, (char *tmpl, int suffixlen, int flags), (tmpl, suffixlen, flags))
