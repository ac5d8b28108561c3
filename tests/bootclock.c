/* A simulated boot for the Slurm testbed (tests/testbed.py, on_reboot): loaded into slurmd with
 * LD_PRELOAD, sysinfo() answers an uptime counted from SLURM_TESTBED_BOOT_EPOCH (seconds since the
 * epoch) instead of the machine's.  slurmd reports its boot time as uptime (sysinfo) and slurmctld
 * takes "now - uptime" as the node's boot time.  slurmd -b ("rebooted when the daemon started")
 * mixes the two clocks: its uptime counts from the first registration in the kernel's whole
 * seconds while slurmctld subtracts it from the wall clock's, so a later registration could put
 * the boot a second after the node's last response, and slurmctld then marks the node DOWN,
 * "Node unexpectedly rebooted" (seen on 22.05 when a resume pinged the node 2 s after its boot).
 * A boot time on the wall clock, two seconds before slurmd starts, never comes after a response. */
#define _GNU_SOURCE
#include <stdlib.h>
#include <sys/syscall.h>
#include <sys/sysinfo.h>
#include <time.h>
#include <unistd.h>

int sysinfo(struct sysinfo *info)
{
	long rc = syscall(SYS_sysinfo, info);
	const char *boot = getenv("SLURM_TESTBED_BOOT_EPOCH");
	if (rc == 0 && boot && *boot) {
		long epoch = strtol(boot, NULL, 10);
		time_t now = time(NULL);
		if (epoch > 0 && now >= epoch)
			info->uptime = now - epoch;
	}
	return (int)rc;
}
