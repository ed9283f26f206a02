"""Reservation filler: lends idle reserved capacity and takes it back."""
