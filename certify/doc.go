// Package certify is the mathematics of cfguard's guarantee: the closed-form KL divergence
// between mean-field Gaussian posteriors, and the paper's Theorems 1 and 2, which turn that KL
// into a lower bound on a counterfactual's predictive probability and an upper bound on its
// predictive variance after a model change.
//
// Notation (paper, Section "Counterfactual Robustness under model changes"): q1 is the posterior
// under which a counterfactual x' was certified (its anchor), q2 the current posterior,
// f(w) = p(y' | x', w) in [0, 1], p_i = E_{q_i}[f], V_i = Var_{q_i}[f].
//
// Paper mode (Theorems 1 and 2, Pinsker's inequality TV <= sqrt(KL/2)):
//
//	p2 >= p1 - 2 sqrt(KL(q2||q1)/2)
//	V2 <= V1 + 6 sqrt(KL(q2||q1)/2)
//
// Tight mode (beyond the paper, opt-in; derived in docs/MATHS.md): for f in [0, 1],
// |E_{q2} f - E_{q1} f| <= TV(q2, q1), and TV <= min(sqrt(KL/2), sqrt(1 - exp(-KL)))
// (Pinsker and Bretagnolle-Huber), so
//
//	p2 >= p1 - TV_ub,   V2 <= min(V1 + 3 TV_ub, 1/4).
//
// Both modes are rigorous; tight mode's constants are half the paper's. VarUpper caps the
// variance bound at 1/4 (the variance of any f in [0, 1]) in both.
//
// Around the theorems, the package holds what the ledger and the daemon judge a stored CE by:
// its statuses and the certificate that admits it (Status, Certificate, Policy and its Slack
// and Gate at a KL; Standing and Rejudge), the empirical-Bernstein evidence of a Monte-Carlo
// measurement (Evidence: Renewable, Reenters, Verdict), whether a verdict still carries to a
// later posterior (VerdictBound, Carries, CarryMargin), an update's outcome against the KL budget
// (Decide, OnBreach), and a Monte-Carlo estimate of the KL conditional on one input (dpi.go).
package certify
