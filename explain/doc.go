// Package explain generates counterfactual explanations (CEs) for a Bayesian MLP (package bnn):
// PSCE, the paper's probabilistically safe counterfactuals, and the paper's four baselines:
// BayesCF (Batten et al. 2025, gradient descent on the posterior predictive), Schut et al.'s
// greedy search, Wachter et al.'s gradient search and ROAR (Upadhyay et al. 2021, recourse robust
// to shifts of a local linear model); each Method's documentation says what it optimises. It also holds the generative models the
// search and its evaluation need: a variational autoencoder (VAE) for PSCE's plausibility terms
// and plain autoencoders (AE) for the IM1 metric. Both are trained by minibatch Adam: the VAE on
// its gradient written out in plain Go (vaeLoss; the tests hold it to a gorgonia graph of the same
// loss and to finite differences), faster than the graph (BenchmarkVAEMinibatch reports the
// ratio), the autoencoders on gorgonia's autodiff.
//
// Everything works in the model's standardised feature space z = (x - mean) / std (the model's
// Scaler); callers pass and receive raw features.
//
// # PSCE
//
// Starting at x' = x, PSCE minimises with Adam (paper, Section "Generating Counterfactuals")
//
//	L(x') = l_class L_clf + l_delta L_delta + l_latent L_ldist + l_var L_var - l_elbo ELBO(x')
//	L_clf   = -E_w[ log p(y' | x', w) ]
//	L_delta = max((1 - delta) - E_w[ p(y' | x', w) ], 0)
//	L_var   = max(Var_w[ p(y' | x', w) ] - epsilon, 0)
//	L_ldist = || mu_enc(x) - mu_enc(x') ||^2
//	ELBO    = E_q(z|x')[ log N(x'; dec(z), obs_var I) ] - KL(q(z|x') || N(0, I))
//
// until x' lies in the <delta, epsilon>-set (certify.InSet)
//
//	S_<delta,epsilon> = { x' : E_w[p(y'|x',w)] >= 1 - delta  and  Var_w[p(y'|x',w)] <= epsilon }
//
// and is classified as y'. The expectations over the posterior q(w) are Monte-Carlo means over S
// sampled networks per iteration (see Config.Samples and Config.PoolSize for how they are drawn);
// the variance uses the unbiased 1/(S-1) estimator; the ELBO uses one reparameterised latent draw
// per iteration. The default weights are DefaultWeights; PaperWeights are the paper's literal
// breast-cancer values (see DefaultWeights for why they differ). Gradients with respect to x'
// flow through the sampled networks and the VAE by gorgonia's symbolic differentiation; the graph
// is built once with bnn.GraphBuilder and only its inputs (sampled weights, ELBO noise) are
// rebound between iterations. The optimiser is bnn.Adam, as everywhere in cfguard.
//
// Set membership and validity are never taken from the optimiser's own minibatch. An iterate is
// accepted only if two further ensembles agree: a confirmation ensemble of Config.CheckSamples
// draws, then the final ensemble of Config.FinalSamples draws, whose estimate is also what the
// Result reports as P1 and Var1. Both are bnn.Pools drawn once per Generator and shared by every
// iteration and every Generate call (common random numbers), so the final draws gate stopping as
// well as measure the result: x' is accepted where these draws say it meets the rule, and P1 is
// measured on the draws that accepted it, which biases it (slightly, at 1000 draws) towards
// success. Hoeffding's P1Lower assumes draws independent of x', so for a Result it is optimistic
// by that selection, and with shared draws it holds per CE, not jointly over many CEs (see
// bnn.Pool). A caller that needs an estimate independent of the search measures the Result again
// with draws of its own. The daemon does not: it passes its registration pool as FinalPool, so
// that the CE it registers carries the measurement that accepted it, with that selection.
//
// A Generate call that ends without a counterfactual that meets the method's rule returns an
// error wrapping ErrNotFound (a *NotFoundError carrying the best attempt, which may be valid and
// still miss the rule, as at the iteration cap); under StopConfirmed (the default) a Result
// always meets it. Config.Stop = StopEstimate replaces the confirmation by the paper's
// protocol: a search stops where its own minibatch estimate meets the rule (or at the iteration
// cap), and the attempt is handed back whatever the final ensemble says of it, to be accepted
// and measured as the paper does.
package explain
