package certify

// Standing is where a stored CE stands between two measurements: its status and, for a certified
// CE, whether the bound of its certificate has lapsed (it fails at the anchor's current KL and
// the renewal is pending; the API's renewal_pending). The zero Standing is a CE not stored yet.
type Standing struct {
	Status Status
	Lapsed bool // only ever set with Status == Certified
}

// Holds reports whether s is certified with a bound that holds.
func (s Standing) Holds() bool { return s.Status == Certified && !s.Lapsed }

// Rejudge is the one rule that moves a CE when the bounds of its certificate are evaluated anew
// (holds is Bounds.Certified, or Gate.Check's answer, at its anchor's KL): when the anchor's KL
// moves, when the indexes are rebuilt, when a CE is registered or its certificate renewed. No
// Monte-Carlo evidence enters it; renewals and verdicts are Renewable, Reenters and Verdict.
//
//	from              bound holds               bound fails
//	(new)             certified                 at_risk (no verdict yet; it never held a
//	                                            certificate, so there is none to lapse)
//	certified         certified                 certified, lapsed (no status change)
//	certified, lapsed certified (restored)      certified, lapsed
//	at_risk           certified                 at_risk (its verdict stands)
//	invalidated       certified                 invalidated (its verdict stands)
//	uncertified       uncertified               uncertified (no theorem applies)
//
// A renewed certificate is judged as Rejudge(Standing{Status: Certified}, holds). Every stored CE
// is a fixed point of the rule: Rejudge(s, holds) == s at its anchor's stored KL.
func Rejudge(prev Standing, holds bool) Standing {
	switch {
	case prev.Status == Uncertified:
		return prev
	case holds:
		return Standing{Status: Certified}
	case prev.Status == Certified:
		return Standing{Status: Certified, Lapsed: true}
	case prev.Status == 0:
		return Standing{Status: AtRisk}
	}
	return prev
}
