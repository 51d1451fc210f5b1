package main

import (
	"github.com/cfguard/cfguard/internal/cli"

	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"math"
	"time"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/experiment"
	"github.com/cfguard/cfguard/update"
)

// learners are the update settings cmdStream compares: the daemon's defaults and the paper's
// Adam protocol with either objective.
var learners = map[string]func() update.Config{
	"default": func() update.Config {
		u := config.Default().Update
		_, c := u.Step(&bnn.Model{Records: 1}, 1, u.Seed)
		c.Represented = 0 // the prior objective's N follows the posterior (vcl does not use it)
		return c
	},
	"paper": func() update.Config {
		return update.Config{Objective: update.ObjectivePrior, Solver: update.SolverAdam}
	},
	"vcl-adam": func() update.Config { return update.Config{Objective: update.ObjectiveVCL, Solver: update.SolverAdam} },
}

// streamSummary is cmdStream's JSON line. Correct and Drift count increments; Invalidated80 and
// InvalidatedAll count drifted records (0: never).
type streamSummary struct {
	Data            string                 `json:"data"`
	Learner         string                 `json:"learner"`
	Increment       int                    `json:"increment"`
	RandomSize      bool                   `json:"random_size"`
	Correct         int                    `json:"correct_increments"`
	Drift           int                    `json:"drift_increments"`
	Shift           string                 `json:"shift"`
	Order           string                 `json:"order"`
	KLWeight        float64                `json:"kl_weight"`
	Memory          float64                `json:"memory"`
	Start           experiment.StreamPoint `json:"start"`
	AfterCorrect    experiment.StreamPoint `json:"after_correct"`
	End             experiment.StreamPoint `json:"end"`
	KLCorrectMean   float64                `json:"kl_correct_mean"`
	KLCorrectMax    float64                `json:"kl_correct_max"`
	KLDriftMean     float64                `json:"kl_drift_mean"`
	KLDriftMax      float64                `json:"kl_drift_max"`
	Breaches        int                    `json:"breaches"`
	Invalidated80   int                    `json:"invalidated_80_after"`
	InvalidatedAll  int                    `json:"invalidated_all_after"`
	TookMeanSeconds float64                `json:"took_mean_seconds"`
	Settle          bool                   `json:"settle"`
	SettleMeans     bool                   `json:"settle_means"`
	SettleKL        float64                `json:"settle_kl"`
	// SettleObjective is the training objective (per row) at the fitted and at the settled last layer.
	SettleObjective [2]float64 `json:"settle_objective"`
}

// cmdStream replays a stream of increments through the daemon's update code on a bundled data
// set (experiment.Stream) and prints one JSON summary.
func cmdStream(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("stream", flag.ContinueOnError)
	data := fs.String("data", "", "CSV file or bundled data set name")
	classes := fs.String("classes", "", "comma-separated class names")
	seed := fs.Uint64("seed", 1, "random seed")
	learner := fs.String("learner", "default", "update settings: default (the daemon's), paper (prior objective, Adam lr 1e-5 x 50) or vcl-adam")
	klw := fs.Float64("kl-weight", 0, "override the learner's update.kl_weight (0: keep)")
	memory := fs.Float64("memory", -1, "override the learner's update.memory_records (-1: keep)")
	inc := fs.Int("increment", 10, "records per increment (with --random, the most)")
	random := fs.Bool("random", false, "increment sizes uniform in [1, --increment]")
	correct := fs.Int("correct", 1000, "increments with correct labels")
	drift := fs.Int("drift", 0, "increments of the drift after them")
	shift := fs.String("shift", "flip", "the drift: flip (every label) or region (labels above the first feature's mean)")
	order := fs.String("order", "shuffled", "how increments take the rows: shuffled, or label (every row of one label, then the next: a backlog sorted by class)")
	every := fs.Int("every", 50, "held-out evaluation every N increments")
	fit := fs.Float64("fit", 0.8, "fraction of the data set (a seeded shuffle) the first posterior is fitted on")
	unseen := fs.Float64("unseen", 0, "fraction after it streamed as rows the fit never saw (0: stream the fitted rows); the rest is held out")
	settle := fs.Bool("settle", false, "before the stream, move the fitted last layer to the optimum of its own training objective (converged, body frozen)")
	settleMeans := fs.Bool("settle-means", false, "as --settle, over the last layer's means only (log sigmas kept at the fit's)")
	if err := cli.ParseFlags(fs, args, stderr); err != nil {
		return err
	}
	if *settle && *settleMeans {
		return fmt.Errorf("%w: --settle and --settle-means: give one (--settle moves the sigmas too)", cli.ErrUsage)
	}
	if err := cli.Required("data", *data); err != nil {
		return err
	}
	mk, ok := learners[*learner]
	if !ok {
		return fmt.Errorf("%w: --learner %q, want default, paper or vcl-adam", cli.ErrUsage, *learner)
	}
	if *inc < 1 || *correct < 0 || *drift < 0 || *every < 1 {
		return fmt.Errorf("%w: --increment and --every must be >= 1, --correct and --drift >= 0", cli.ErrUsage)
	}
	if !(*klw >= 0) || math.IsInf(*klw, 1) {
		return fmt.Errorf("%w: --kl-weight %v, want a finite weight > 0, or 0 to keep the learner's", cli.ErrUsage, *klw)
	}
	if !(*memory >= 0 || *memory == -1) || math.IsInf(*memory, 1) {
		return fmt.Errorf("%w: --memory %v, want a finite number of records >= 0 (0: every record), or -1 to keep the learner's", cli.ErrUsage, *memory)
	}
	if *shift != "flip" && *shift != "region" {
		return fmt.Errorf("%w: --shift %q, want flip or region", cli.ErrUsage, *shift)
	}
	if *order != "shuffled" && *order != "label" {
		return fmt.Errorf("%w: --order %q, want shuffled or label", cli.ErrUsage, *order)
	}
	if !(*fit > 0 && *unseen >= 0 && *fit+*unseen < 1) {
		return fmt.Errorf("%w: --fit %v and --unseen %v: want --fit > 0, --unseen >= 0 and their sum < 1 (the rest is held out)", cli.ErrUsage, *fit, *unseen)
	}
	set, names, err := cli.LoadData(*data, *classes)
	if err != nil {
		return err
	}
	uc := mk()
	if *klw > 0 {
		uc.KLWeight = *klw
	}
	if *memory >= 0 {
		uc.Memory = *memory
	}
	if err := uc.Validate(); err != nil {
		return fmt.Errorf("%w: %v", cli.ErrUsage, err)
	}
	sum := streamSummary{Data: *data, Learner: *learner, Increment: *inc, RandomSize: *random, Correct: *correct, Drift: *drift,
		Shift: *shift, Order: *order, KLWeight: uc.KLWeight, Memory: uc.Memory, Settle: *settle, SettleMeans: *settleMeans}
	var took time.Duration
	n := 0
	res, err := experiment.Stream(ctx, experiment.StreamConfig{Data: set, Classes: names, Seed: *seed, Update: uc, Increment: *inc,
		FitFrac: *fit, StreamFrac: *unseen, Order: *order, Settle: *settle, SettleMeans: *settleMeans,
		RandomSize: *random, Correct: *correct, Drift: *drift, Shift: *shift, EvalEvery: *every,
		Progress: func(p experiment.StreamPoint) {
			n++
			took += p.Took
			if p.Increment <= *correct {
				sum.KLCorrectMean += p.KL / float64(*correct)
				sum.KLCorrectMax = max(sum.KLCorrectMax, p.KL)
			} else {
				sum.KLDriftMean += p.KL / float64(*drift)
				sum.KLDriftMax = max(sum.KLDriftMax, p.KL)
			}
			if p.Evaluated {
				fmt.Fprintf(stderr, "increment %d: %d records (%d of the drift), held-out NLL %.4f ECE %.4f, stand-ins mean p %.3f, %d invalidated, %d renewable, KL %.3g\n",
					p.Increment, p.Records, p.Drifted, p.NLL, p.ECE, p.StandInMean, p.Invalidated, p.Renewable, p.KL)
			}
		}})
	if err != nil {
		return err
	}
	sum.Start, sum.AfterCorrect, sum.End = res.Start, res.AfterCorrect, res.Start
	if len(res.Points) > 0 { // --correct 0 --drift 0 streams no increment: the end is the start
		sum.End = res.Points[len(res.Points)-1]
	}
	sum.SettleKL, sum.SettleObjective = res.Settled.KL, [2]float64{res.Settled.LossStart, res.Settled.LossEnd}
	sum.Breaches, sum.Invalidated80, sum.InvalidatedAll = res.Breaches, res.First80, res.FirstAllInvalidated
	if n > 0 {
		sum.TookMeanSeconds = (took / time.Duration(n)).Seconds()
	}
	enc := json.NewEncoder(stdout)
	return enc.Encode(sum)
}
