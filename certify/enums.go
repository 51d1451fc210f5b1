package certify

import "fmt"

// UnmarshalText decodes a mode name (config certify.mode); see ParseMode.
func (m *Mode) UnmarshalText(b []byte) error {
	v, err := ParseMode(string(b))
	if err != nil {
		return err
	}
	*m = v
	return nil
}

// OnBreach is the daemon's policy when an update KL exceeds the KL budget (config
// certify.on_breach).
type OnBreach string

const (
	// Alert promotes the update and alerts: certificates are re-judged by their anchors' KL.
	Alert OnBreach = "alert"
	// Reject keeps the previous posterior, holds the increment (its records are published for
	// replay) and alerts.
	Reject OnBreach = "reject"
	// Clip scales the update along the (mu, log sigma) segment so that its KL meets the budget.
	Clip OnBreach = "clip"
)

// UnmarshalText accepts alert, reject or clip.
func (p *OnBreach) UnmarshalText(b []byte) error {
	switch v := OnBreach(b); v {
	case Alert, Reject, Clip:
		*p = v
		return nil
	}
	return fmt.Errorf("unknown on_breach policy %q (want alert, reject or clip)", b)
}

// OutsideSet says what registration does with a CE outside its <delta, epsilon>-set (config
// certify.uncertified).
type OutsideSet string

const (
	// Refuse answers 422: no theorem applies to such a CE.
	Refuse OutsideSet = "refuse"
	// Store keeps it with status uncertified (an audit may certify it later).
	Store OutsideSet = "store"
)

// UnmarshalText accepts refuse or store.
func (o *OutsideSet) UnmarshalText(b []byte) error {
	switch v := OutsideSet(b); v {
	case Refuse, Store:
		*o = v
		return nil
	}
	return fmt.Errorf("unknown policy for CEs outside the set %q (want refuse or store)", b)
}
