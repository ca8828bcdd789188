"""The shared conformance suite every vendor runs through `hal`; it arrives with the conformance issue."""
