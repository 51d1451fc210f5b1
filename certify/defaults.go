package certify

// DefaultSamples is the default number of Monte-Carlo posterior draws S used to measure a
// certificate (p1, V1) and to confirm a counterfactual whose bound fails (config
// certify.samples). With S = 1000 the Hoeffding margin sqrt(ln(1/alpha) / (2 S)) is 0.048 at
// alpha = 0.01. The config layer and the ledger take their default from here.
const DefaultSamples = 1000
