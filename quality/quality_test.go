package quality

import (
	"math"
	"math/rand/v2"
	"slices"
	"testing"
)

func TestScore(t *testing.T) {
	b, err := Score([][]float64{{0.9, 0.1}, {0.3, 0.7}, {0.5, 0.5}}, []int{0, 0, 1})
	if err != nil {
		t.Fatal(err)
	}
	ll := -math.Log(0.9) - math.Log(0.3) - math.Log(0.5)
	br := (0.01 + 0.01) + (0.49 + 0.49) + (0.25 + 0.25)
	if b.Records != 3 || math.Abs(b.LogLoss-ll) > 1e-12 || math.Abs(b.Brier-br) > 1e-12 || b.Correct != 1 {
		t.Errorf("got %+v, want log loss %v, brier %v, 1 correct", b, ll, br)
	}
	// Top-class confidences 0.9 (hit, bin 9), 0.7 (miss, bin 7), 0.5 (ties go to class 0: a miss, bin 5).
	mll, mbr, acc, ece := b.Means()
	if want := (math.Abs(1-0.9) + math.Abs(0-0.7) + math.Abs(0-0.5)) / 3; math.Abs(ece-want) > 1e-12 || math.Abs(acc-1.0/3) > 1e-12 {
		t.Errorf("ece %v accuracy %v, want %v and 1/3", ece, acc, want)
	}
	if math.Abs(mll-ll/3) > 1e-12 || math.Abs(mbr-0.5) > 1e-12 {
		t.Errorf("mean log loss %v, mean Brier %v; want %v and 0.5", mll, mbr, ll/3)
	}
	for _, bad := range []struct {
		p [][]float64
		y []int
	}{
		{[][]float64{{0.5, 0.5}}, []int{2}},
		{[][]float64{{math.NaN(), 1}}, []int{0}},
		{[][]float64{{0.5, 0.5}}, []int{0, 1}},
		{[][]float64{{0.5, 0.5}}, []int{-1}},                     // a label below 0
		{[][]float64{{0.4, 0.6}, {-0.2, 0.6, 0.6}}, []int{0, 1}}, // a probability below 0, the others in [0, 1]
		{[][]float64{{1.2, 0}}, []int{0}},                        // a probability above 1
	} {
		if _, err := Score(bad.p, bad.y); err == nil {
			t.Errorf("Score(%v, %v) took bad input", bad.p, bad.y)
		}
	}
	// A certain, wrong forecast costs MaxLogLoss, not +Inf.
	if b, _ := Score([][]float64{{1, 0}}, []int{1}); b.LogLoss != MaxLogLoss {
		t.Errorf("log loss of a certain miss %v, want %v", b.LogLoss, MaxLogLoss)
	}
}

func TestWindowKeepsTheNewestRecords(t *testing.T) {
	w := Window{Size: 25}
	for i := 0; i < 10; i++ {
		b, _ := Score([][]float64{{1, 0}, {1, 0}, {1, 0}, {1, 0}, {1, 0}, {1, 0}, {1, 0}, {1, 0}, {1, 0}, {1, 0}},
			[]int{i % 2, i % 2, i % 2, i % 2, i % 2, i % 2, i % 2, i % 2, i % 2, i % 2})
		w.Push(b)
	}
	// Increments of 10: the window keeps the newest 3 (30 >= 25 records, 20 would not do).
	s := w.Sum()
	if s.Records != 30 || s.Correct != 10 {
		t.Errorf("window holds %d records, %d correct; want 30 and 10 (increments 7, 8, 9)", s.Records, s.Correct)
	}
	// At a size the increments fill exactly, the window holds that many records, no more.
	w = Window{Size: 20}
	for i := 0; i < 5; i++ {
		b, _ := Score([][]float64{{1, 0}, {1, 0}, {1, 0}, {1, 0}, {1, 0}, {1, 0}, {1, 0}, {1, 0}, {1, 0}, {1, 0}}, make([]int, 10))
		w.Push(b)
	}
	if n := w.Sum().Records; n != 20 {
		t.Errorf("a window of 20 records over increments of 10 holds %d records, want 20", n)
	}
}

// TestDetectorFalseAlarmsAndDelay simulates per-record Brier scores: a stationary stream must not
// alarm (the default's rate is 1e-6 per record), and a rise of the mean by D must be detected
// within about Lambda / (D - Delta) records.
func TestDetectorFalseAlarmsAndDelay(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	// A model right with probability 0.95 at confidence ~0.95: Brier 2 (1-p)^2 or 2 p^2.
	score := func(pRight float64) []float64 {
		p := 0.9 + 0.1*rng.Float64()
		y := 0
		if rng.Float64() > pRight {
			y = 1
		}
		return []float64{p, 1 - p, float64(y)}
	}
	batch := func(n int, pRight float64) Batch {
		probs, ys := make([][]float64, n), make([]int, n)
		for i := range probs {
			s := score(pRight)
			probs[i], ys[i] = s[:2], int(s[2])
		}
		b, _ := Score(probs, ys)
		return b
	}
	d := NewDetector()
	if math.Abs(d.Lambda-4*math.Log(1e6)/(8*0.05)) > 1e-9 {
		t.Fatalf("lambda %v", d.Lambda)
	}
	for i := 0; i < 2000; i++ { // 200,000 stationary records
		if a := d.Observe(batch(100, 0.95)); a != 0 || d.Improvements != 0 {
			t.Fatalf("false alarm or reset after %d stationary records: %d alarms, %d resets", (i+1)*100, a, d.Improvements)
		}
	}
	// Labels flip: the model is now right 5% of the time; the mean Brier score rises by ~1.6.
	base := d
	n := 0
	for d.Changes == base.Changes {
		d.Observe(batch(1, 0.05))
		n++
		if n > 1000 {
			t.Fatal("no alarm within 1000 flipped records")
		}
	}
	if bound := int(d.Lambda/(1.6-d.Delta)) + 20; n > bound {
		t.Errorf("alarm after %d flipped records, want <= %d", n, bound)
	}
	if err := d.Validate(); err != nil {
		t.Error(err)
	}
}

// TestDetectorWalkByHand pins Observe's Page-Hinkley walk to hand-computed values: with
// Delta 0.5 and Brier scores 0, 0, 3 the running means are 0, 0, 1 and the walk
// S_t = S_{t-1} + x_t - mean_t - Delta goes -0.5, -1, 0.5, so the statistic S_t - min S is 0, 0, 1.5.
// The third record alarms when Lambda is below 1.5 (not at 1.5: the statistic must exceed it) and
// MinRecords at most 3; an alarm resets the
// count, the mean and both walks, so that the next record (0) starts a new reference at -Delta.
func TestDetectorWalkByHand(t *testing.T) {
	for _, tc := range []struct {
		name       string
		lambda     float64
		minRecords int
		alarmAt    int // 0: none
	}{
		{"over lambda", 1.2, 2, 3},
		{"under lambda", 1.6, 2, 0},
		{"at lambda", 1.5, 2, 0},
		{"during the warm-up", 1.2, 4, 0},
		{"just after the warm-up", 1.2, 3, 3},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d := &Detector{Delta: 0.5, Lambda: tc.lambda, MinRecords: tc.minRecords}
			wantStat := []float64{0, 0, 1.5}
			for i, x := range []float64{0, 0, 3} {
				alarms := d.Observe(Batch{brier: []float64{x}})
				if i+1 == tc.alarmAt {
					if alarms != 1 || d.Changes != 1 || d.Count != 0 || d.Mean != 0 || d.Sum != 0 || d.Min != 0 || d.Fall != 0 || d.FallMin != 0 {
						t.Fatalf("record %d: %d alarms, detector %+v; want one alarm and a reset", i+1, alarms, *d)
					}
					continue
				}
				if alarms != 0 || math.Abs(d.Statistic()-wantStat[i]) > 1e-12 || d.Count != i+1 {
					t.Fatalf("record %d: %d alarms, statistic %v, count %d; want none, %v, %d", i+1, alarms, d.Statistic(), d.Count, wantStat[i], i+1)
				}
			}
			if tc.alarmAt == 0 {
				return
			}
			d.Observe(Batch{brier: []float64{0}})
			if d.Count != 1 || d.Mean != 0 || d.Sum != -0.5 || d.Min != -0.5 || d.Statistic() != 0 {
				t.Fatalf("the record after an alarm: %+v, want count 1, mean 0, walk and minimum -0.5", *d)
			}
		})
	}
}

// TestDetectorFallWalkByHand pins the walk of falls, sum (mean_t - x_t - Delta), to hand-computed
// values: with Delta 0.5 and Brier scores 3, 3, 0 the running means are 3, 3, 2 and the walk goes
// -0.5, -1, 0.5, its height over its minimum 0, 0, 1.5 (the walk of rises goes -0.5, -1, -3.5 and
// never climbs). The third record resets the detector without an alarm (an improvement) when
// Lambda is below 1.5, not at 1.5 (the height must exceed it), and not during the warm-up; the
// reset clears the count, the mean and both walks, so that the next record (0) starts a new
// reference at -Delta.
func TestDetectorFallWalkByHand(t *testing.T) {
	for _, tc := range []struct {
		name       string
		lambda     float64
		minRecords int
		resetAt    int // 0: none
	}{
		{"over lambda", 1.2, 2, 3},
		{"at lambda", 1.5, 2, 0},
		{"during the warm-up", 1.2, 4, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d := &Detector{Delta: 0.5, Lambda: tc.lambda, MinRecords: tc.minRecords}
			wantHeight := []float64{0, 0, 1.5}
			for i, x := range []float64{3, 3, 0} {
				if alarms := d.Observe(Batch{brier: []float64{x}}); alarms != 0 || d.Changes != 0 {
					t.Fatalf("record %d: %d alarms (%d in all) from a fall of the scores", i+1, alarms, d.Changes)
				}
				if i+1 == tc.resetAt {
					if d.Improvements != 1 || d.Count != 0 || d.Mean != 0 || d.Sum != 0 || d.Min != 0 || d.Fall != 0 || d.FallMin != 0 {
						t.Fatalf("record %d: detector %+v; want one improvement and a reset", i+1, *d)
					}
					continue
				}
				if h := d.Fall - d.FallMin; d.Improvements != 0 || math.Abs(h-wantHeight[i]) > 1e-12 || d.Count != i+1 {
					t.Fatalf("record %d: %d improvements, fall walk height %v, count %d; want none, %v, %d", i+1, d.Improvements, h, d.Count, wantHeight[i], i+1)
				}
			}
			if tc.resetAt == 0 {
				return
			}
			d.Observe(Batch{brier: []float64{0}})
			if d.Count != 1 || d.Mean != 0 || d.Fall != -0.5 || d.FallMin != -0.5 || d.Sum != -0.5 || d.Min != -0.5 {
				t.Fatalf("the record after an improvement: %+v, want count 1, mean 0, both walks and minima -0.5", *d)
			}
		})
	}
}

// TestCalibrationErrorBinsByConfidence: two records whose top-class probabilities (0.85, a
// hit; 0.89, a miss) share the bin [0.8, 0.9) are judged together, |1 - 1.74| / 2 = 0.37, not
// one by one ((0.15 + 0.89) / 2 = 0.52); a probability of exactly 1 falls in the last bin.
func TestCalibrationErrorBinsByConfidence(t *testing.T) {
	b, err := Score([][]float64{{0.85, 0.15}, {0.89, 0.11}, {0, 1}}, []int{0, 1, 1})
	if err != nil {
		t.Fatal(err)
	}
	if got := b.Bins[8]; got.Count != 2 || math.Abs(got.Confidence-1.74) > 1e-12 || got.Correct != 1 {
		t.Fatalf("bin 8 holds %+v, want 2 records of confidence 1.74, 1 correct", got)
	}
	if got := b.Bins[Bins-1]; got.Count != 1 || got.Confidence != 1 || got.Correct != 1 {
		t.Fatalf("the last bin holds %+v, want the certain hit", got)
	}
	if _, _, _, ece := b.Means(); math.Abs(ece-(0.74+0)/3) > 1e-12 {
		t.Fatalf("ece %v, want %v", ece, 0.74/3)
	}
}

// At the default Lambda the warm-up decides nothing: from a reset, the walk cannot climb Lambda
// within the first 100 records whatever the scores, so DefaultMinRecords only matters for a
// smaller Lambda. The steepest climb is k scores of 0 then scores of 2 (2k ln(t/k) by record t,
// at most 2t/e: 74 at t = 100, Lambda = 138.2 not before t = 188); a detector without the
// warm-up, fed every such step and 2,000 random sequences, does not alarm before record 150. With
// a Lambda of 50 it does, and the warm-up holds the alarm to record 100.
func TestDetectorWarmUpAtTheDefaults(t *testing.T) {
	if d := NewDetector(); d.MinRecords != 100 {
		t.Fatalf("the default warm-up is %d records; this test and docs/MATHS.md reason about 100", d.MinRecords)
	}
	first := func(d Detector, xs []float64) int { return firstAlarm(&d, xs) } // from d's state, not changing it
	step := func(k int) []float64 {
		xs := make([]float64, 150)
		for i := k; i < len(xs); i++ {
			xs[i] = 2
		}
		return xs
	}
	bare := NewDetector()
	bare.MinRecords = 0
	for k := 1; k < 150; k++ {
		if got := first(bare, step(k)); got != 0 {
			t.Errorf("%d scores of 0 then 2s: an alarm at record %d, within 150 of the start", k, got)
		}
	}
	rng := rand.New(rand.NewPCG(5, 6))
	for range 2000 {
		xs := make([]float64, 150)
		for i := range xs {
			xs[i] = 2 * rng.Float64() * float64(i) / 150
		}
		if got := first(bare, xs); got != 0 {
			t.Fatalf("random rising scores: an alarm at record %d, within 150 of the start", got)
		}
	}
	low := NewDetector()
	low.Lambda, low.MinRecords = 50, 0
	if got := first(low, step(37)); got == 0 || got >= DefaultMinRecords {
		t.Fatalf("Lambda 50 without the warm-up: alarm at record %d, want one before %d", got, DefaultMinRecords)
	}
	low.MinRecords = DefaultMinRecords
	if got := first(low, step(37)); got != DefaultMinRecords {
		t.Errorf("Lambda 50 with the default warm-up: alarm at record %d, want %d", got, DefaultMinRecords)
	}
}

// TestDetectorValidate: a detector read back from storage with settings no detector is made
// with (a drift allowance or threshold not above 0, negative counts, a state that is not
// finite) is refused; the default one is not.
func TestDetectorValidate(t *testing.T) {
	if d := NewDetector(); d.Validate() != nil {
		t.Fatalf("the default detector: %v", d.Validate())
	}
	for name, change := range map[string]func(*Detector){
		"delta 0":               func(d *Detector) { d.Delta = 0 },
		"lambda 0":              func(d *Detector) { d.Lambda = 0 },
		"negative count":        func(d *Detector) { d.Count = -1 },
		"negative changes":      func(d *Detector) { d.Changes = -1 },
		"negative improvements": func(d *Detector) { d.Improvements = -1 },
		"NaN sum":               func(d *Detector) { d.Sum = math.NaN() },
		"infinite mean":         func(d *Detector) { d.Mean = math.Inf(1) },
		"NaN delta":             func(d *Detector) { d.Delta = math.NaN() },
		"infinite lambda":       func(d *Detector) { d.Lambda = math.Inf(1) },
		"minimum -Inf":          func(d *Detector) { d.Min = math.Inf(-1) },
		"negative warm-up":      func(d *Detector) { d.MinRecords = -1 },
	} {
		d := NewDetector()
		change(&d)
		if d.Validate() == nil {
			t.Errorf("a detector with %s validated", name)
		}
	}
}

// TestLogLossClipsAt20Nats: a record's log loss is -ln p_y up to MaxLogLoss = 20 nats (p_y =
// e^-20 ~ 2e-9), and 20 below that: p_y = e^-19 costs 19, unclipped; e^-25 and 0 cost 20.
func TestLogLossClipsAt20Nats(t *testing.T) {
	if MaxLogLoss != 20 {
		t.Fatalf("MaxLogLoss is %v; the package doc and this test reason about 20 nats", MaxLogLoss)
	}
	for _, tc := range []struct{ py, want float64 }{
		{math.Exp(-19), 19},
		{math.Exp(-25), 20},
		{0, 20},
	} {
		b, err := Score([][]float64{{1 - tc.py, tc.py}}, []int{1})
		if err != nil {
			t.Fatal(err)
		}
		if math.Abs(b.LogLoss-tc.want) > 1e-9 {
			t.Errorf("p_y %v: log loss %v, want %v", tc.py, b.LogLoss, tc.want)
		}
	}
}

// TestCalibrationBinEdges: bin b holds top-class probabilities in [b/10, (b+1)/10): a
// probability on an edge opens the upper bin (0.5 in bin 5, 0.8 in bin 8), not the lower one.
func TestCalibrationBinEdges(t *testing.T) {
	b, err := Score([][]float64{{0.5, 0.5}, {0.2, 0.8}, {0.8, 0.2}}, []int{0, 1, 1})
	if err != nil {
		t.Fatal(err)
	}
	want := [Bins]Bin{5: {Count: 1, Confidence: 0.5, Correct: 1}, 8: {Count: 2, Confidence: 1.6, Correct: 1}}
	for k := range want {
		if got := b.Bins[k]; got.Count != want[k].Count || got.Correct != want[k].Correct || math.Abs(got.Confidence-want[k].Confidence) > 1e-12 {
			t.Errorf("bin %d holds %+v, want %+v", k, got, want[k])
		}
	}
}

// TestWindowSumIsTheScoreOfItsRecords: after increments are pushed and the oldest dropped, the
// window's batch is, field by field (log loss, Brier, hits, every bin's count, confidence and
// hits), the score of the kept increments' records scored together, and its means are theirs.
func TestWindowSumIsTheScoreOfItsRecords(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	w := Window{Size: 20}
	var probs [][][]float64
	var ys [][]int
	for i := 0; i < 9; i++ {
		n := 3 + i%5 // increments of 3 to 7 records
		p, y := make([][]float64, n), make([]int, n)
		for j := range p {
			a, c := rng.Float64(), rng.Float64()
			p[j], y[j] = []float64{a / (1 + a + c), 1 / (1 + a + c), c / (1 + a + c)}, rng.IntN(3)
		}
		b, err := Score(p, y)
		if err != nil {
			t.Fatal(err)
		}
		probs, ys = append(probs, p), append(ys, y)
		w.Push(b)
	}
	// The kept increments: the fewest newest ones covering 20 records.
	var p [][]float64
	var y []int
	for i := len(probs) - 1; len(y) < 20; i-- {
		p, y = slices.Concat(probs[i], p), slices.Concat(ys[i], y)
	}
	want, err := Score(p, y)
	if err != nil {
		t.Fatal(err)
	}
	got := w.Sum()
	if got.Records != want.Records || got.Correct != want.Correct || math.Abs(got.LogLoss-want.LogLoss) > 1e-9 || math.Abs(got.Brier-want.Brier) > 1e-9 {
		t.Errorf("window %+v, want %+v", got, want)
	}
	for k := range got.Bins {
		if g, e := got.Bins[k], want.Bins[k]; g.Count != e.Count || g.Correct != e.Correct || math.Abs(g.Confidence-e.Confidence) > 1e-9 {
			t.Errorf("window bin %d %+v, want %+v", k, g, e)
		}
	}
	// The means, computed directly from the records.
	var ll, br float64
	hits := 0
	for i, row := range p {
		ll -= math.Log(row[y[i]])
		for c, v := range row {
			if c == y[i] {
				v = 1 - v
			}
			br += v * v
		}
		if top := argmax(row); top == y[i] {
			hits++
		}
	}
	n := float64(len(y))
	mll, mbr, acc, _ := got.Means()
	if math.Abs(mll-ll/n) > 1e-9 || math.Abs(mbr-br/n) > 1e-9 || math.Abs(acc-float64(hits)/n) > 1e-12 {
		t.Errorf("window means %v %v %v, want %v %v %v", mll, mbr, acc, ll/n, br/n, float64(hits)/n)
	}
}

func argmax(p []float64) int {
	top := 0
	for c := range p {
		if p[c] > p[top] {
			top = c
		}
	}
	return top
}

// TestMeansOfNoRecords: an empty batch's means are all 0, not 0/0.
func TestMeansOfNoRecords(t *testing.T) {
	if ll, br, acc, ece := (Batch{}).Means(); ll != 0 || br != 0 || acc != 0 || ece != 0 {
		t.Errorf("means of no records %v %v %v %v, want all 0", ll, br, acc, ece)
	}
}

// TestSumsCarryNoRecordScores: the detector sees each record once, through the batch it was
// scored in; a sum of batches (Add, a window's) carries no per-record scores to feed it again.
func TestSumsCarryNoRecordScores(t *testing.T) {
	a, err := Score([][]float64{{0.9, 0.1}, {0.2, 0.8}}, []int{0, 0})
	if err != nil {
		t.Fatal(err)
	}
	b, err := Score([][]float64{{0.6, 0.4}}, []int{1})
	if err != nil {
		t.Fatal(err)
	}
	d := NewDetector()
	d.Observe(a.Add(b))
	if d.Count != 0 {
		t.Errorf("a detector fed a.Add(b) counted %d records, want 0", d.Count)
	}
}

// coinScores draws n Brier scores of mean m from a confident binary model: 2 (a miss at
// probability 1) with probability m/2, else 0; the largest variance scores of mean m can have.
func coinScores(rng *rand.Rand, n int, m float64) []float64 {
	xs := make([]float64, n)
	for i := range xs {
		if rng.Float64() < m/2 {
			xs[i] = 2
		}
	}
	return xs
}

// firstAlarm feeds xs to d record by record and returns the 1-based index of the first alarm,
// 0 for none.
func firstAlarm(d *Detector, xs []float64) int {
	for i, x := range xs {
		if d.Observe(Batch{brier: []float64{x}}) > 0 {
			return i + 1
		}
	}
	return 0
}

// A model that got better (mean Brier 0.4 for 50,000 records, then 0.1 for 50,000) and then
// worse (0.25, a rise of D = 0.15) is flagged within about Lambda / (D - Delta) records of the
// rise: the fall of its scores reset the reference (an improvement, no alarm), which otherwise
// would have stayed near 0.25, the mean of everything seen, and never let the walk climb.
func TestDetectorResetsAfterTheScoresFall(t *testing.T) {
	for seed := range uint64(10) {
		rng := rand.New(rand.NewPCG(4, seed))
		d := NewDetector()
		firstAlarm(&d, coinScores(rng, 50_000, 0.4))
		firstAlarm(&d, coinScores(rng, 50_000, 0.1))
		if d.Changes != 0 || d.Improvements == 0 {
			t.Fatalf("seed %d: %d alarms and %d resets while the scores fell; want none and at least one", seed, d.Changes, d.Improvements)
		}
		claim := d.Lambda / (0.15 - d.Delta)
		if got := firstAlarm(&d, coinScores(rng, 20_000, 0.25)); got == 0 || float64(got) > 2*claim {
			t.Errorf("seed %d: a rise of the mean Brier score from 0.1 to 0.25 after the fall: first alarm after %d records (0: none in 20,000), want within 2 x %.0f", seed, got, claim)
		}
	}
}

// From N records of reference at a constant score, a rise by D at record N + 1 climbs the walk
// by D N (H_{N+k} - H_N) - Delta k after k records (H the harmonic numbers: the running mean
// absorbs the rise as D k / (N + k)), about D N ln(1 + k / N) - Delta k. The detector alarms at
// the first k where that exceeds Lambda, computed here on its own. The climb peaks at
// k = N (D / Delta - 1): after 100 or 1,000 records of reference a rise by 0.2 never climbs
// Lambda (138.2; it peaks at about 12.7 and 127), after 10,000 it is found after about 990
// records and after 100,000 after about Lambda / (D - Delta) = 921. A flip (D = 1.7) is found
// after 136 records from 100 of reference and 98 from 300, against 84 from a long one.
func TestDetectorAfterAShortReference(t *testing.T) {
	const before = 0.1
	for _, tc := range []struct {
		n      int
		rise   float64
		within int // the first alarm is expected within this many records of the rise; 0: never
	}{
		{100, 0.2, 0}, {1_000, 0.2, 0}, {10_000, 0.2, 1_000}, {100_000, 0.2, 930},
		{100, 1.7, 140}, {300, 1.7, 100}, // a flip: Lambda / (D - Delta) = 84
	} {
		d := NewDetector()
		flat := make([]float64, tc.n)
		for i := range flat {
			flat[i] = before
		}
		if got := firstAlarm(&d, flat); got != 0 {
			t.Fatalf("%d records of one score: an alarm at %d", tc.n, got)
		}
		want, h := 0, 0.0 // h = H_{N+k} - H_N
		for k := 1; k <= 20_000 && want == 0; k++ {
			h += 1 / float64(tc.n+k)
			if tc.rise*float64(tc.n)*h-d.Delta*float64(k) > d.Lambda*(1+1e-9) {
				want = k
			}
		}
		up := make([]float64, 20_000)
		for i := range up {
			up[i] = before + tc.rise
		}
		got := firstAlarm(&d, up)
		if got != want || (tc.within == 0) != (got == 0) || got > tc.within {
			t.Errorf("%d records of reference, then a rise by %v: first alarm after %d records, the walk's formula says %d (want within %d; 0: never)", tc.n, tc.rise, got, want, tc.within)
		}
		t.Logf("%d records of reference: a rise by %v found after %d records (Lambda / (D - Delta) = %.0f)", tc.n, tc.rise, got, d.Lambda/(tc.rise-d.Delta))
	}
}

// Both walks keep the false-event rate of the threshold (at most 1e-6 per record, each, with the
// mean known) on the hardest stationary scores, 0 or 2 with equal probability (variance 1, the
// largest): in 10^7 records at most 10 alarms and 10 resets, the bound's expectation (none happen
// with this seed).
func TestDetectorFalseEventsOnTheHardestScores(t *testing.T) {
	rng := rand.New(rand.NewPCG(8, 9))
	d := NewDetector()
	xs := make([]float64, 1_000_000)
	alarms := 0
	for range 10 {
		for i := range xs {
			xs[i] = float64(2 * rng.IntN(2))
		}
		alarms += d.Observe(Batch{brier: xs})
	}
	t.Logf("10^7 stationary records of variance 1: %d alarms, %d resets", alarms, d.Improvements)
	if alarms > 10 || d.Improvements > 10 {
		t.Errorf("10^7 stationary records: %d alarms and %d resets, the bound allows about 10 of each", alarms, d.Improvements)
	}
}
