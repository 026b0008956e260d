/*
 * SPANK plugin: the `--singularity-sla=premium|standard|basic` option of sbatch, salloc and srun.
 *
 * Local side (sbatch): validates the tier and puts it in the job's control environment, from where
 * Slurm hands it to the job-submit policy (job_desc.spank_job_env), to Prolog and Epilog
 * (SPANK_SINGULARITY_SLA) and to the batch job (SLURM_SPANK_SINGULARITY_SLA).
 * Remote side (slurmstepd): exports SINGULARITY_SLA to every task, also for jobs submitted without the
 * option, by mapping the job's partition back to its tier with the arguments given in plugstack.conf:
 *
 *     required /opt/singularity-slurm/lib/singularity_sla.so premium=premium standard=standard basic=basic
 *
 * The option must be registered with spank_option_register() from slurm_spank_init: sbatch ignores a
 * static spank_options[] table.
 *
 * With `ensure=PROGRAM` (the Prolog, e.g. ensure=/opt/singularity-slurm/venv/bin/singularity-prolog),
 * every job step also makes sure, as root and before the step runs, that the job's node services run
 * on its node: slurmd skips the Prolog when a requeued job starts again on a node within the
 * credential lifetime (the job id is still in its credential cache), which the launcher's lifted
 * requeue delay makes the usual case.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>
#include <slurm/spank.h>

SPANK_PLUGIN(singularity_sla, 1);

#define NTIERS 3
static const char *tiers[NTIERS] = { "premium", "standard", "basic" };
static char partitions[NTIERS][128] = { "premium", "standard", "basic" };
static char chosen[16];
static char ensure_program[512];

static int tier_index(const char *name)
{
	for (int i = 0; name && i < NTIERS; i++)
		if (strcmp(name, tiers[i]) == 0)
			return i;
	return -1;
}

static int sla_option_cb(int val, const char *optarg, int remote)
{
	(void) val;
	(void) remote;
	if (tier_index(optarg) < 0) {
		slurm_error("--singularity-sla=%s: unknown SLA tier; valid tiers: premium, standard, basic",
			    optarg ? optarg : "");
		return ESPANK_BAD_ARG;
	}
	snprintf(chosen, sizeof(chosen), "%s", optarg);
	return ESPANK_SUCCESS;
}

static struct spank_option sla_option = {
	"singularity-sla", "TIER",
	"SLA tier of the job: premium (>= 95% of its ideal GPU time each hour), standard (>= 70%) "
	"or basic (best effort, preempted first). Default: set by the site.",
	1, 0, (spank_opt_cb_f) sla_option_cb
};

static int parse_args(int ac, char **av)
{
	for (int i = 0; i < ac; i++) {
		char *eq = strchr(av[i], '=');
		int idx;
		if (strncmp(av[i], "ensure=", 7) == 0) {
			snprintf(ensure_program, sizeof(ensure_program), "%s", av[i] + 7);
			continue;
		}
		if (!eq) {
			slurm_error("singularity_sla: plugstack.conf argument '%s' is not TIER=PARTITION", av[i]);
			return -1;
		}
		*eq = '\0';
		idx = tier_index(av[i]);
		if (idx < 0) {
			slurm_error("singularity_sla: plugstack.conf names unknown tier '%s'; valid tiers: "
				    "premium, standard, basic", av[i]);
			*eq = '=';
			return -1;
		}
		snprintf(partitions[idx], sizeof(partitions[idx]), "%s", eq + 1);
		*eq = '=';
	}
	return 0;
}

int slurm_spank_init(spank_t sp, int ac, char **av)
{
	spank_context_t ctx = spank_context();

	if (parse_args(ac, av) < 0)
		return -1;
	if (ctx == S_CTX_LOCAL || ctx == S_CTX_ALLOCATOR || ctx == S_CTX_REMOTE)
		return spank_option_register(sp, &sla_option) == ESPANK_SUCCESS ? 0 : -1;
	return 0;
}

static const char *tier_of_partition(const char *partition)
{
	for (int i = 0; i < NTIERS; i++)
		if (strcmp(partition, partitions[i]) == 0)
			return tiers[i];
	return NULL;
}

/*
 * Run the Prolog in `--ensure` mode (it returns at once when the services already run). This runs as
 * root inside the user's step, whose environment the user wrote: only SPANK items (which slurmstepd
 * has from slurmd and the job credential) go to the Prolog, which reads everything else (node name,
 * partition, restart count, GPUs) from Slurm's record of the job and step. Never spank_getenv here.
 */
static void ensure_node_services(spank_t sp)
{
	uint32_t job_id = 0, step_id = 0, node_id = 0;
	uid_t uid = 0;
	gid_t gid = 0;
	char env_job[64], env_uid[64], env_gid[64], env_step[64], env_node[64];
	pid_t pid;
	int status;

	if (!ensure_program[0] || spank_get_item(sp, S_JOB_ID, &job_id) != ESPANK_SUCCESS ||
	    spank_get_item(sp, S_JOB_UID, &uid) != ESPANK_SUCCESS ||
	    spank_get_item(sp, S_JOB_GID, &gid) != ESPANK_SUCCESS ||
	    spank_get_item(sp, S_JOB_STEPID, &step_id) != ESPANK_SUCCESS ||
	    spank_get_item(sp, S_JOB_NODEID, &node_id) != ESPANK_SUCCESS) {
		if (ensure_program[0])
			slurm_error("singularity_sla: SPANK items of the job are unavailable; node services "
				    "not checked");
		return;
	}
	snprintf(env_job, sizeof(env_job), "SLURM_JOB_ID=%u", job_id);
	snprintf(env_uid, sizeof(env_uid), "SLURM_JOB_UID=%u", (unsigned) uid);
	snprintf(env_gid, sizeof(env_gid), "SLURM_JOB_GID=%u", (unsigned) gid);
	snprintf(env_step, sizeof(env_step), "SLURM_STEP_ID=%u", step_id);
	snprintf(env_node, sizeof(env_node), "SLURM_NODEID=%u", node_id);
	pid = fork();
	if (pid == 0) {
		char *argv[] = { ensure_program, "--ensure", NULL };
		char *envp[] = { env_job, env_uid, env_gid, env_step, env_node,
				 "PATH=/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL=C", NULL };
		execve(ensure_program, argv, envp);
		_exit(127);
	}
	if (pid > 0 && waitpid(pid, &status, 0) == pid && !(WIFEXITED(status) && WEXITSTATUS(status) == 0))
		slurm_error("singularity_sla: %s --ensure failed for job %u (step %u, node index %u)",
			    ensure_program, job_id, step_id, node_id);
}

int slurm_spank_init_post_opt(spank_t sp, int ac, char **av)
{
	spank_context_t ctx = spank_context();

	(void) ac;
	(void) av;
	if (ctx == S_CTX_REMOTE && getuid() == 0)
		ensure_node_services(sp);
	if ((ctx == S_CTX_LOCAL || ctx == S_CTX_ALLOCATOR) && chosen[0])
		if (spank_job_control_setenv(sp, "SINGULARITY_SLA", chosen, 1) != ESPANK_SUCCESS) {
			slurm_error("singularity_sla: cannot pass the SLA tier to the job");
			return -1;
		}
	return 0;
}

int slurm_spank_user_init(spank_t sp, int ac, char **av)
{
	char partition[128];
	const char *tier = chosen[0] ? chosen : NULL;

	(void) ac;
	(void) av;
	if (!spank_remote(sp))
		return 0;
	if (!tier && spank_getenv(sp, "SLURM_JOB_PARTITION", partition, sizeof(partition)) ==
			     ESPANK_SUCCESS)
		tier = tier_of_partition(partition);
	if (tier)
		spank_setenv(sp, "SINGULARITY_SLA", tier, 1);
	return 0;
}
