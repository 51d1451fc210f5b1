package certify

import "fmt"

// Outcome is what became of one update (one posterior transition proposed from an increment).
//
//	promoted  applied as computed: version v -> v+1
//	clipped   applied after scaling the update down until its update KL met the KL budget
//	rejected  the update KL exceeded the KL budget and the policy refused it; the posterior is kept
//	failed    the update itself failed (non-finite values, bad data); the posterior is kept
//
// The zero value is not an outcome; ParseOutcome and UnmarshalText never produce it.
type Outcome string

// The outcomes. Their strings are metric label values and are stored in the ledger's KL history:
// never rename.
const (
	OutcomePromoted Outcome = "promoted"
	OutcomeClipped  Outcome = "clipped"
	OutcomeRejected Outcome = "rejected"
	OutcomeFailed   Outcome = "failed"
)

// Outcomes returns every outcome in a fixed order, for metrics that create all label values up
// front.
func Outcomes() []Outcome {
	return []Outcome{OutcomePromoted, OutcomeClipped, OutcomeRejected, OutcomeFailed}
}

// Valid reports whether o is one of the four outcomes.
func (o Outcome) Valid() bool {
	switch o {
	case OutcomePromoted, OutcomeClipped, OutcomeRejected, OutcomeFailed:
		return true
	}
	return false
}

// String is the outcome's name.
func (o Outcome) String() string { return string(o) }

// ParseOutcome accepts exactly the four names.
func ParseOutcome(name string) (Outcome, error) {
	if o := Outcome(name); o.Valid() {
		return o, nil
	}
	return "", fmt.Errorf("unknown update outcome %q (want promoted, clipped, rejected or failed)", name)
}

// MarshalText encodes the outcome by name; an invalid outcome is an error.
func (o Outcome) MarshalText() ([]byte, error) {
	if !o.Valid() {
		return nil, fmt.Errorf("invalid update outcome %q", string(o))
	}
	return []byte(o), nil
}

// UnmarshalText decodes an outcome name.
func (o *Outcome) UnmarshalText(b []byte) error {
	v, err := ParseOutcome(string(b))
	if err != nil {
		return err
	}
	*o = v
	return nil
}

// Decide is the on-breach policy: what becomes of an update whose KL(q_new || q_prev) is kl,
// under the budget (0.5 - delta)^2 / 2 and the policy p. Within the budget (kl <= budget) the
// update is promoted whatever p says; over it, alert promotes it (and the caller alerts), reject
// keeps the previous posterior, clip promotes the update scaled down to the budget. over says
// whether the budget was exceeded (the event and the warning the caller owes). A kl that is not a
// number is over every budget.
func Decide(kl, budget float64, p OnBreach) (o Outcome, over bool) {
	if kl <= budget {
		return OutcomePromoted, false
	}
	switch p {
	case Reject:
		return OutcomeRejected, true
	case Clip:
		return OutcomeClipped, true
	}
	return OutcomePromoted, true
}
