"""What to change, in which order, and who may change it: placement of replicas on
cards, the plan of desired against actual, the model controller's and on-demand
lifecycle's decisions, draining a replica out of rotation, and the cluster lock that
keeps one writer at a time.
"""
