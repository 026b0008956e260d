/*
 * LD_PRELOAD shim for criu: reads another process's resource limits from /proc/PID/limits when the
 * prlimit64 system call is refused.
 *
 * criu reads every dumped task's limits with syscall(__NR_prlimit64, pid, res, NULL, &old). For a
 * task of another user the kernel demands CAP_SYS_RESOURCE, which root lacks on some hosts (VMs and
 * containers that drop it from the bounding set): the dump then fails with "Can't get rlimit 0".
 * /proc/PID/limits holds the same values and is readable by everyone. The shim only acts when the
 * real call failed with EPERM on a read-only query, so on a normal host it changes nothing.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

static long (*real_syscall)(long, ...);

static int limits_from_proc(pid_t pid, int resource, struct rlimit64 *out)
{
	char path[64], line[256];
	FILE *f;
	int index = -1;
	snprintf(path, sizeof(path), "/proc/%d/limits", (int) pid);
	f = fopen(path, "re");
	if (!f)
		return -1;
	while (fgets(line, sizeof(line), f)) {
		char soft[32], hard[32];
		if (index++ < 0)
			continue; /* header */
		if (index - 1 != resource)
			continue;
		if (sscanf(line + 26, "%31s %31s", soft, hard) != 2)
			break;
		out->rlim_cur = strcmp(soft, "unlimited") == 0 ? RLIM64_INFINITY : strtoull(soft, NULL, 10);
		out->rlim_max = strcmp(hard, "unlimited") == 0 ? RLIM64_INFINITY : strtoull(hard, NULL, 10);
		fclose(f);
		return 0;
	}
	fclose(f);
	return -1;
}

long syscall(long number, ...)
{
	va_list ap;
	long a[6];
	long ret;
	va_start(ap, number);
	for (int i = 0; i < 6; i++)
		a[i] = va_arg(ap, long);
	va_end(ap);
	if (!real_syscall)
		real_syscall = (long (*)(long, ...)) dlsym(RTLD_NEXT, "syscall");
	ret = real_syscall(number, a[0], a[1], a[2], a[3], a[4], a[5]);
	if (ret == -1 && errno == EPERM && number == SYS_prlimit64 && a[2] == 0 && a[3] != 0) {
		if (limits_from_proc((pid_t) a[0], (int) a[1], (struct rlimit64 *) a[3]) == 0) {
			errno = 0;
			return 0;
		}
		errno = EPERM;
	}
	return ret;
}
