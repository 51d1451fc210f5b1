// Package quality judges the served model the prequential way (Dawid 1984: test, then train):
// every record of an increment is scored under the posterior that was current before the
// increment was applied, so that each score is an honest out-of-sample forecast. It summarises
// scores per increment (Batch), over a window of recent increments (Window), and watches the
// per-record Brier score for a rise with a Page-Hinkley test (Detector).
//
// For a record with label y and predictive probabilities p_1..p_C:
//
//	log loss  -log p_y                         (clipped at MaxLogLoss)
//	Brier     sum_c (p_c - [c = y])^2          in [0, 2]
//	correct   argmax_c p_c = y
//	ECE       sum_b (|B_b| / n) |acc(B_b) - conf(B_b)| over Bins equal-width bins of the top
//	          class's probability
package quality

import (
	"errors"
	"fmt"
	"math"
)

// Bins is the number of confidence bins of the calibration error.
const Bins = 10

// MaxLogLoss clips a record's log loss (p_y below e^-MaxLogLoss), so that one record cannot make
// a window's mean infinite.
const MaxLogLoss = 20.0

// Bin accumulates the records whose top-class probability fell in one bin.
type Bin struct {
	Count      int     `json:"n"`
	Confidence float64 `json:"conf"` // sum of top-class probabilities
	Correct    int     `json:"hits"`
}

// Batch is the sum of the prequential scores of some records.
type Batch struct {
	Records int       `json:"records"`
	LogLoss float64   `json:"log_loss"` // sums over records
	Brier   float64   `json:"brier"`
	Correct int       `json:"correct"`
	Bins    [Bins]Bin `json:"bins"`
	brier   []float64 // per record, in order, for the detector (not stored)
}

// Score scores records with labels y under predictive probabilities probs (one row of C per
// record, each summing to ~1). It fails on mismatched lengths, a label out of range, or a
// probability that is not finite or not in [0, 1].
func Score(probs [][]float64, y []int) (Batch, error) {
	var b Batch
	if len(probs) != len(y) {
		return b, fmt.Errorf("quality: %d predictions for %d labels", len(probs), len(y))
	}
	for i, p := range probs {
		if y[i] < 0 || y[i] >= len(p) {
			return Batch{}, fmt.Errorf("quality: record %d: label %d out of range [0, %d)", i, y[i], len(p))
		}
		top, brier := 0, 0.0
		for c, v := range p {
			if !(v >= 0 && v <= 1) {
				return Batch{}, fmt.Errorf("quality: record %d: probability of class %d is %v", i, c, v)
			}
			if v > p[top] {
				top = c
			}
			d := v
			if c == y[i] {
				d = v - 1
			}
			brier += d * d
		}
		b.Records++
		b.LogLoss += min(-math.Log(p[y[i]]), MaxLogLoss)
		b.Brier += brier
		b.brier = append(b.brier, brier)
		k := min(int(p[top]*Bins), Bins-1)
		b.Bins[k].Count++
		b.Bins[k].Confidence += p[top]
		if top == y[i] {
			b.Correct++
			b.Bins[k].Correct++
		}
	}
	return b, nil
}

// Add returns the sum of two batches.
func (b Batch) Add(o Batch) Batch {
	b.Records += o.Records
	b.LogLoss += o.LogLoss
	b.Brier += o.Brier
	b.Correct += o.Correct
	for k := range b.Bins {
		b.Bins[k].Count += o.Bins[k].Count
		b.Bins[k].Confidence += o.Bins[k].Confidence
		b.Bins[k].Correct += o.Bins[k].Correct
	}
	b.brier = nil
	return b
}

// Means returns the mean log loss, Brier score and accuracy, and the calibration error; all 0
// for an empty batch.
func (b Batch) Means() (logLoss, brier, accuracy, ece float64) {
	if b.Records == 0 {
		return 0, 0, 0, 0
	}
	n := float64(b.Records)
	for _, bin := range b.Bins {
		ece += math.Abs(float64(bin.Correct)-bin.Confidence) / n
	}
	return b.LogLoss / n, b.Brier / n, float64(b.Correct) / n, ece
}

// Window keeps the batches of the most recent increments covering at least Size records.
type Window struct {
	Size    int
	batches []Batch
	sum     Batch
}

// Push adds an increment's batch and drops the oldest ones that the window no longer needs.
func (w *Window) Push(b Batch) {
	b.brier = nil
	w.batches = append(w.batches, b)
	w.sum = w.sum.Add(b)
	for len(w.batches) > 1 && w.sum.Records-w.batches[0].Records >= w.Size {
		w.sum = w.sum.sub(w.batches[0])
		w.batches = w.batches[1:]
	}
}

// Sum is the window's batch.
func (w *Window) Sum() Batch { return w.sum }

func (b Batch) sub(o Batch) Batch {
	b.Records -= o.Records
	b.LogLoss -= o.LogLoss
	b.Brier -= o.Brier
	b.Correct -= o.Correct
	for k := range b.Bins {
		b.Bins[k].Count -= o.Bins[k].Count
		b.Bins[k].Confidence -= o.Bins[k].Confidence
		b.Bins[k].Correct -= o.Bins[k].Correct
	}
	return b
}

// The detector's defaults. A record's Brier score lies in [0, B] with B = 2. If the scores are
// independent with a constant mean mu, the walk S_t = sum (x_i - mu - Delta) drifts down by
// Delta per record, and by Hoeffding's lemma exp(theta (S_t - S_s)) with theta = 8 Delta / B^2
// is a supermartingale from any start s; Ville's inequality then bounds the probability that the
// walk ever climbs Lambda above a start by exp(-8 Lambda Delta / B^2). An alarm needs such a
// climb from the walk's running minimum, which starts anew at most once per record, so false
// alarms occur at most at rate exp(-8 Lambda Delta / B^2) per record. With Delta = 0.05 and
// DefaultFalseAlarmRate = 1e-6, Lambda = B^2 ln(1e6) / (8 Delta) = 138.2: at most one false alarm
// in a million records (about six days at 2 records/s), and a rise of the mean Brier score by D
// is detected after about Lambda / (D - Delta) records (~80-90 for labels that flip, D ~ 1.6-1.8). The
// bound takes mu as known; the detector uses the running mean since its last reset instead, and
// waits for DefaultMinRecords before it may alarm (at the default Lambda the walk cannot climb
// that far within 100 records of a reset anyway: TestDetectorWarmUpAtTheDefaults).
//
// The running mean forgets nothing since the last reset, so that a model that got better would
// keep a reference above what it does now, and a rise back towards its old level would never
// climb the walk. A second walk, sum (mean_i - x_i - Delta), watches for a fall of the scores by
// the same test (same Delta and Lambda, so at most as many false resets as false alarms); when it
// climbs Lambda the reference starts again from the new level, without an alarm. A rise is
// detected after about Lambda / (D - Delta) records once the level before it held for several
// times that long since the last reset; within a few hundred records of a reset the running mean
// is still learning the level and absorbs part of a rise (from N records of reference, a rise by D
// climbs about D N ln(1 + k/N) - Delta k after k records: TestDetectorAfterAShortReference).
const (
	DefaultDelta          = 0.05
	DefaultFalseAlarmRate = 1e-6
	DefaultMinRecords     = 100
	brierRange            = 2.0
)

// LambdaFor returns the Page-Hinkley threshold whose false-alarm rate per record is at most rate
// for a tolerance delta on scores in [0, 2]: 4 ln(1/rate) / (8 delta).
func LambdaFor(rate, delta float64) float64 {
	return brierRange * brierRange * math.Log(1/rate) / (8 * delta)
}

// Detector is a one-sided Page-Hinkley test for a rise of the mean of per-record Brier scores.
// Its state is plain data, stored with each increment's prequential record (rejected and failed
// updates included) so that a restart goes on where it was and every record is counted once.
type Detector struct {
	Delta      float64 `json:"delta"`
	Lambda     float64 `json:"lambda"`
	MinRecords int     `json:"min_records"`
	// State since the last reset: records, their mean, the walk and its minimum, and the walk
	// of falls (sum (mean_i - x_i - Delta)) and its minimum.
	Count   int     `json:"count"`
	Mean    float64 `json:"mean"`
	Sum     float64 `json:"sum"`
	Min     float64 `json:"min"`
	Fall    float64 `json:"fall"`
	FallMin float64 `json:"fall_min"`
	// Changes counts alarms since the detector was made; Improvements the resets after a fall of
	// the scores (no alarm).
	Changes      int `json:"changes"`
	Improvements int `json:"improvements"`
}

// NewDetector returns a detector with the default tolerance, false-alarm rate and warm-up.
func NewDetector() Detector {
	return Detector{Delta: DefaultDelta, Lambda: LambdaFor(DefaultFalseAlarmRate, DefaultDelta), MinRecords: DefaultMinRecords}
}

// Validate checks a detector's settings and state (one read back from storage).
func (d *Detector) Validate() error {
	for _, v := range []float64{d.Delta, d.Lambda, d.Mean, d.Sum, d.Min, d.Fall, d.FallMin} {
		if math.IsNaN(v) || math.IsInf(v, 0) {
			return errors.New("quality: detector state is not finite")
		}
	}
	if d.Delta <= 0 || d.Lambda <= 0 || d.Count < 0 || d.MinRecords < 0 || d.Changes < 0 || d.Improvements < 0 {
		return fmt.Errorf("quality: detector settings delta %v, lambda %v, min records %d, count %d, changes %d, improvements %d",
			d.Delta, d.Lambda, d.MinRecords, d.Count, d.Changes, d.Improvements)
	}
	return nil
}

// Statistic is the walk's height above its minimum, S_t - min S; the detector alarms when it
// exceeds Lambda.
func (d *Detector) Statistic() float64 { return d.Sum - d.Min }

// Observe feeds the batch's records in order and returns how many alarms they raised. After an
// alarm, or a significant fall of the scores, the detector resets, so that the new regime
// becomes its reference.
func (d *Detector) Observe(b Batch) int {
	alarms := 0
	for _, x := range b.brier {
		d.Count++
		d.Mean += (x - d.Mean) / float64(d.Count)
		d.Sum += x - d.Mean - d.Delta
		d.Min = min(d.Min, d.Sum)
		d.Fall += d.Mean - x - d.Delta
		d.FallMin = min(d.FallMin, d.Fall)
		switch {
		case d.Count < d.MinRecords:
		case d.Sum-d.Min > d.Lambda:
			alarms++
			d.Changes++
			d.reset()
		case d.Fall-d.FallMin > d.Lambda:
			d.Improvements++
			d.reset()
		}
	}
	return alarms
}

// reset starts the reference and both walks again from the next record.
func (d *Detector) reset() {
	d.Count, d.Mean, d.Sum, d.Min, d.Fall, d.FallMin = 0, 0, 0, 0, 0, 0
}
