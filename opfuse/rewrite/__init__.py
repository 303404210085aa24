"""Graph -> Graph passes that run before fusion."""
