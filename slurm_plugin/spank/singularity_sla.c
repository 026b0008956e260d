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
 */
#include <stdio.h>
#include <string.h>
#include <slurm/spank.h>

SPANK_PLUGIN(singularity_sla, 1);

#define NTIERS 3
static const char *tiers[NTIERS] = { "premium", "standard", "basic" };
static char partitions[NTIERS][128] = { "premium", "standard", "basic" };
static char chosen[16];

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

int slurm_spank_init_post_opt(spank_t sp, int ac, char **av)
{
	spank_context_t ctx = spank_context();

	(void) ac;
	(void) av;
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
		for (int i = 0; i < NTIERS; i++)
			if (strcmp(partition, partitions[i]) == 0)
				tier = tiers[i];
	if (tier)
		spank_setenv(sp, "SINGULARITY_SLA", tier, 1);
	return 0;
}
