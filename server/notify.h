/*
 * moed_notify — tells the service manager how the daemon is doing (sd_notify's protocol): READY=1
 * once it serves, STOPPING=1 when it drains, STATUS=... lines a person reads in `systemctl
 * status`. Without $NOTIFY_SOCKET (not started by systemd with Type=notify) it does nothing.
 */
#ifndef MOED_NOTIFY_H
#define MOED_NOTIFY_H

/* Sends one datagram of newline-separated assignments ("READY=1\nSTATUS=serving"), formatted
 * printf-style. Returns 1 if sent, 0 when there is no socket to send to, or MOED_EIO (also
 * logged) when $NOTIFY_SOCKET is set but the send failed. */
int moed_notify(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

#endif
