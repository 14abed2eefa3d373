"""SGLang's contract as data: its server flags and its sampling checks, per release, read from its
source (the login node has no SGLang)."""
